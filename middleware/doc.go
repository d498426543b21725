// Package middleware holds the interceptors that wrap a Processor, as a stack of Spring AOP
// advisors wraps a message processor in Java (docs/background.md): Tracing, Metrics (the
// performance monitor), DeadLetter, Recover, Retry, Timeout, Transaction, Deduplicate,
// NaturalIdempotency, GroupCommit and GroupTransaction, composed by Chain. An interceptor, in
// the router's words, is one of these middlewares under a name (Handler.Interceptors).
//
// Middlewares run in the order given: the first is the outermost, so it sees the message first
// and the outcome last.
//
// The canonical chain for exactly-once processing, outermost first, is
//
//	Tracing -> Metrics -> DeadLetter -> Recover -> Retry -> Timeout -> Transaction -> Deduplicate -> Processor
//
// (docs/concepts.md has the chain of every quality of service).
//
// Retry sits outside Transaction so that every attempt gets a fresh transaction; Deduplicate
// sits inside it so that the message id is recorded in the same transaction as the business
// writes and commits or rolls back with them. The router builds this chain for each quality of
// service; users who compose their own keep these two rules.
//
// GroupCommit takes the place of Transaction and Deduplicate when the deliveries waiting for a
// handler should share one transaction and one commit (optionally handed to a processor.Batch
// in one call); GroupTransaction takes the place of Transaction alone. Retry stays outside them.
// Their processor is a Joiner: a consumer may hand it a message directly (Join) and be called
// back with the result, without a goroutine waiting, running itself the Observers before it
// (Tracing and Metrics are made of TracingObserver and MetricsObserver) and sending only a
// message whose first attempt did not commit through the rest of the chain (AfterJoin). The
// router does so for every chain of built-ins with group commit.
//
// Messages that cannot succeed: Retry does not retry an error its Classifier finds permanent
// (DefaultClassifier: data errors, business unique violations, decode errors, invalid ids) and
// makes it processor.Permanent; DeadLetter publishes permanent failures to the dead-letter
// topic, and with WithMaxDeliveries gives up a message at its delivery limit, so that nothing
// is redelivered for ever.
//
// AtLeastOnce, ExactlyOnce and ExactlyOnceInOrder compose the middlewares given as Stages in
// the canonical order, for a program that builds its chain itself.
//
// The facts the middlewares of one delivery share (its retries, its commit) are recorded in
// its context and read by any middleware through DeliveryFrom; a middleware that takes the
// place of a built-in records them with RecordRetry and RecordCommit, so that the others, and
// the router, see what it did.
//
// No middleware acknowledges a message. The chain returns an error (or nil) and the router alone
// maps it to ack or nack, after the transaction's outcome is known.
package middleware
