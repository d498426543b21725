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
// QoS has a canonical chain of stages (QoS.Chain), outermost first:
//
//	Tracing -> Metrics -> DeadLetter -> Recover -> Retry -> Timeout -> Transaction -> Deduplicate -> Processor
//
// Stages run in the order given: the first is the outermost, so it sees the message first and
// the outcome last. The chain is a value (Chain): printed, and edited by position, a stage of
// one's own (Use, UseObserver, UseFactory) goes in with one line, and every stage not edited
// stays the library's:
//
//	chain := onceflow.ExactlyOnce.Chain().Before(onceflow.StageRetry, onceflow.Use("tenant", tenant))
//
// A stage's name says its role; which implementation runs it (a transaction per message or per
// group, duplicate detection by id or by offset, ...) is the Handler's configuration. A setting
// that the chain would ignore, and a chain that drops what its QoS promises without saying so
// (Risk), is an error at Router.AddHandler.
//
// Handler.Converter takes a converter of one's own; converter.Config.ID takes the message id
// from a payload field or any function of the message, so that a message without an id of its
// own is still processed exactly once by the business key it carries.
//
// The router alone turns the outcome of the chain into an ack or a nack; see Router.
package onceflow
