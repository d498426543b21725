// Package onceflow is a framework for exactly-once message processing without XA.
//
// A message arrives from a broker (RabbitMQ, Kafka, a SQL queue, NATS JetStream, Redis Streams or
// the embedded SQLite queue). A chain of interceptors wraps the user's processor.Processor:
// tracing, metrics, dead-lettering, panic recovery, retry, a local database transaction, and
// duplicate detection that records the message id in that same transaction. The broker message
// is acknowledged only after the database commit. A redelivered message finds its id recorded
// and is acknowledged without being processed again, so each message's effect is in the
// database exactly once across crashes, redeliveries, reconnects and competing consumers.
//
// A Router runs Handlers. Each handler names a topic, a subscriber, a processor, a database and
// a quality of service (QoS): BestEffort, AtLeastOnce, ExactlyOnce or ExactlyOnceInOrder. The
// router builds the canonical chain for the QoS, outermost first:
//
//	Tracing -> Metrics -> DeadLetter -> Recover -> Retry -> Timeout -> Transaction -> Deduplicate -> Processor
//
// Middlewares run in the order given: the first is the outermost, so it sees the message first
// and the outcome last. An interceptor is a named middleware factory: the name a handler lists,
// and the function that builds the middleware (package middleware) for that handler. A handler
// may list interceptors by name instead of taking its QoS chain (Handler.Interceptors),
// including custom ones registered with Router.RegisterInterceptor and middleware values of
// its own (Handler.Middlewares). A program that composes a chain without the router takes the
// canonical order from middleware.ExactlyOnce and its siblings.
//
// Handler.Converter takes a converter of one's own; converter.Config.ID takes the message id
// from a payload field or any function of the message, so that a message without an id of its
// own is still processed exactly once by the business key it carries.
//
// The router alone turns the outcome of the chain into an ack or a nack; see Router.
package onceflow
