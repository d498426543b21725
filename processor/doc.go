// Package processor defines the Processor that user code implements, the control-flow errors
// it returns, and the accessor through which it reaches the database transaction.
//
// A Processor applies the effect of one message. It does not commit, acknowledge or retry:
// the middlewares around it and the router do that, following this table:
//
//	processor returns            the transaction       the broker sees
//	nil                          committed             ack, after the commit
//	ErrDuplicate (or wrapping)   rolled back           ack, nothing applied twice
//	Permanent(err)               rolled back           message on the dead-letter topic, then ack
//	any other error              rolled back           retried in process, then nack (redelivery)
//	panic                        rolled back           nack (redelivery)
//
// The transaction is opened by the Transaction middleware, reached with TxFromContext, and
// committed or rolled back by that middleware alone: a processor must never call Commit or
// Rollback itself.
package processor
