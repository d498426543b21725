// Package processor defines the Processor that user code implements (and Batch, its form for a
// group of messages), the control-flow errors it returns, and the accessor through which it
// reaches the database transaction.
//
// A Processor applies the effect of one message. It does not commit, acknowledge or retry:
// the middlewares around it and the router do that, following this table:
//
//	processor returns               the transaction   the broker sees
//	nil                             committed         ack, after the commit
//	ErrDuplicate (or wrapping)      rolled back       ack, nothing applied twice
//	Permanent(err), or an error     rolled back       message on the dead-letter topic with the
//	running again cannot cure                         reason, then ack
//	any other error                 rolled back       retried in process, then nack: delivered
//	                                                  again after a delay that grows with the
//	                                                  delivery count
//	panic                           rolled back       nack, delivered again after the delay
//
// Errors that running again cannot cure are permanent without Permanent: the handler's
// classifier (middleware.DefaultClassifier unless Handler.DeadLetter.Classifier replaces it) takes data
// errors of the database (a value too long, a NOT NULL, CHECK or foreign-key violation), a
// unique violation of the business tables, JSON decoding errors and message ids that cannot be
// recorded for permanent, and a lost connection, a serialization failure, a deadlock or an
// error it cannot place for retryable.
//
// A message that keeps failing, or panicking, or makes its consumer crash, is not delivered for
// ever: at the handler's delivery limit (Handler.DeadLetter.MaxDeliveries, 10 by default) it is
// dead-lettered with the reason "delivery limit reached after N deliveries: <the last error>"
// and acknowledged.
//
// The transaction is opened by the Transaction middleware (or group commit), reached with
// TxFromContext, and committed or rolled back by that middleware alone: a processor must never
// call Commit or Rollback itself.
package processor
