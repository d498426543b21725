// Package middleware holds the interceptors that wrap a Processor, as a stack of Spring AOP
// advisors wraps a message processor in Java (docs/background.md), composed by Chain: Tracing,
// Metrics (the performance monitor), DeadLetter, Recover, Retry, Timeout, Transaction and Dedup
// (duplicate detection). Each configurable one is a configuration struct whose zero value is
// its default configuration and whose Middleware method builds it, with an error naming the
// first invalid field; onceflow.Handler holds the same structs, and the router builds the
// stages of a handler's chain from them.
//
// Middlewares run in the order given: the first is the outermost, so it sees the message first
// and the outcome last.
//
// The canonical chain for exactly-once processing, outermost first, is
//
//	Tracing -> Metrics -> DeadLetter -> Recover -> Retry -> Timeout -> Transaction -> Deduplicate -> Processor
//
// (onceflow.QoS.Chain returns it as a value, and docs/concepts.md has the chain of every
// quality of service). Retry sits outside Transaction so that every attempt gets a fresh
// transaction; duplicate detection sits inside it so that what it records commits with the
// business writes, or rolls back with them.
//
// Messages that cannot succeed: DeadLetter publishes permanent failures to the dead-letter
// topic, as its Classifier tells them from the others (DefaultClassifier: data errors, business
// unique violations, decode errors, invalid ids), and gives up a message at its delivery limit,
// so that nothing is redelivered for ever; Retry, inside it, does not retry what it classifies
// as permanent.
//
// The facts the stages of one delivery share (its retries, its commit, its classifier) are
// recorded in its context and read by any middleware through DeliveryFrom.
//
// No middleware acknowledges a message. The chain returns an error (or nil) and the router alone
// maps it to ack or nack, after the transaction's outcome is known.
package middleware
