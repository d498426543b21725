// Package nats is onceflow's subscriber for NATS JetStream: a watermill message.Subscriber that
// keeps many deliveries in flight, on nats.go's own client, and the nats:// scheme of
// broker.Open, which it registers when a program imports it:
//
//	import _ "github.com/onceflow/onceflow/broker/nats"
//
// The scheme publishes with watermill-nats's publisher and subscribes with this Subscriber; they
// share the names of streams and consumers (StreamName, ConsumerName), the creation of a
// topic's stream (Streams) and the tolerant unmarshaler of the wire format that watermill-nats's
// publisher writes (Unmarshal).
//
// # Consumers
//
// Every consumer group has one durable pull consumer per topic, named ConsumerName(group,
// topic), with explicit acknowledgements, AckWait = Config.AckWait, no delivery limit
// (MaxDeliver -1: onceflow's router counts deliveries and dead-letters a message at its limit,
// with the reason; a server-side limit would stop delivering it silently) and no limit on
// pending acknowledgements (MaxAckPending -1: each subscription bounds its own). Subscribe
// creates it when there is none, delivering the whole stream; it tries again for half a
// second while the server refuses it as it creates a new topic's stream ("invalid stream").
// Each Subscribe call is one puller on it: subscriptions of a group, in any number of
// processes, compete for its messages. A push consumer of that name, left by onceflow's
// earlier watermill-nats subscriber, is replaced by a pull consumer that starts right after
// its ack floor; while a subscriber still receives from it, Subscribe fails, saying what to do.
//
// # Delivery
//
// A subscription pulls from the consumer as many messages as its window (Config.Prefetch) has
// room for, in batches. The delivery count is JetStream's (NumDelivered, kept by the server,
// so it survives the death of a consumer), and nacks are delayed (DelaysNacks). A delivery
// ends, as package broker says, also when its AckWait passes (ErrAckWaitPassed) or its
// connection is lost (ErrConnectionLost).
//
//   - Ack acknowledges that one message, asynchronously; Close waits for the server to confirm.
//   - Nack makes JetStream deliver the message again, its count up by one, after
//     redelivery.RequestedDelay, or Config.NackDelay (NakWithDelay). The messages behind it
//     are not held back.
//   - A delivery whose AckWait passed, or whose connection was lost, is left to the server,
//     which delivers it again once AckWait has passed; its ack or nack is ignored.
//   - A subscription that ends, or a Subscriber that closes, gives back what it holds
//     unsettled at once (a nak), for another consumer of the group to take.
//   - A consumer that dies leaves its deliveries to the others after AckWait.
//
// The connection reconnects by itself, for ever; the subscriptions go on when it is back.
//
// # NATS server 2.9
//
// The subscriber works around two bugs of NATS server 2.9 in pull requests (nats-server #5305,
// fixed in 2.11, and #3942).
package nats
