// Package redis is a watermill message.Subscriber on Redis Streams that keeps many deliveries
// in flight per subscription, built on go-redis. It reads the stream entries of
// watermill-redisstream (Marshaller), whose publisher the redis:// and rediss:// schemes of
// broker.Open use; the package registers them when a program imports it:
//
//	import _ "github.com/onceflow/onceflow/broker/redis"
//
// # Delivery
//
// Each Subscribe call is one consumer (a name of its own) of the stream in the configured
// consumer group, which is created from the start of the stream when it does not exist. A
// subscription:
//
//   - reads new entries with XREADGROUP COUNT <room> BLOCK as its window (Config.Prefetch) has
//     room, and hands them out in stream order;
//   - claims the group's entries that have been idle for Config.AckTimeout (XAUTOCLAIM, one
//     pass over the pending entries list every Config.ClaimInterval, shared by the
//     Subscriber's subscriptions to the stream): those of consumers that died, closed, or
//     were nacked with a delay that has ended;
//   - counts deliveries with the group's pending entries list (redelivery.Info.Count: 1 for a
//     new entry, each claim adds one), durable in Redis; DelaysNacks is true;
//   - ends a delivery, as package broker says, also when its AckTimeout passes (another
//     consumer may claim the entry) or the connection is lost.
//
// An ack settles its entry by id (XACK), coalesced with the acks given within a few
// milliseconds into one XACK. An ack given after its delivery ended is dropped: the entry is
// delivered again, and an old delivery never settles a newer delivery of the same entry.
//
// A nacked entry leaves the window at once, and is delivered again, its count up by one, no
// sooner than redelivery.RequestedDelay, or else Config.NackDelay. The delay is kept in Redis
// as the entry's idle time, so a nacked entry comes back on time also when its consumer dies
// or closes; but Redis cannot set an idle time ahead of the clock, so a delay longer than
// AckTimeout is kept by the consumer while it lives, and if it dies or closes first, the entry
// comes back within AckTimeout, sooner than asked.
//
// # Close, lost connections, dead consumers
//
// Close (and the end of a subscription's context) stops reading, sends the acks given before
// it, makes the unsettled deliveries claimable by the other consumers at once, and returns
// within Config.CloseTimeout. After a lost connection the subscription ends the deliveries in
// flight, waits for Redis, gives them back (and entries whose read reply was lost) and goes on.
// The entries of a consumer that dies without closing come back after AckTimeout. A closing
// subscription deletes its consumer from the group when nothing is pending for it; the others
// delete consumers that have had nothing pending and not been seen for 10 minutes.
//
// # Server and connections
//
// The subscriber needs Redis 7.0 or later: XAUTOCLAIM, and claims that drop from the pending
// entries list the entries deleted from the stream (XDEL, as the broker's Move does, or XTRIM)
// instead of replying with nil as 6.2 does. A subscription sends its XREADGROUPs on a
// connection of its own, taken from the client's pool, so that Close can end a blocked read at
// once (CLIENT UNBLOCK); past half the pool's size, or with a cluster client, it reads on the
// pool, and Close waits up to Config.BlockTime for the read.
package redis
