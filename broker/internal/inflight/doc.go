// Package inflight is the in-flight engine under onceflow's broker subscribers: the subscriber
// side of package broker/redelivery, written once. A scheme's package supplies a Source, what
// is its broker's own (fetching, settling in its own frames, giving back); the engine does the
// rest of each subscription:
//
//   - the window: up to Options.Prefetch deliveries unsettled, and a fetch for the free room
//     once half the window is free (or Options.FillWait after room came free, at once after
//     redelivery.Flush or Hurry, or, with Options.Eager, after a fetch that came back short);
//   - the hand-out of the deliveries on the subscription's channel, in the order Emit got
//     them, by one goroutine, so that fetching never waits for the consumer;
//   - each delivery's context: a redelivery.Info (DelaysNacks always: the engine holds a nack
//     the broker cannot delay), cancelled when the delivery ends, with the cause;
//   - deadlines (a lease, AckWait), under one timer per subscription;
//   - settlement: directly in the consumer's goroutine when it subscribed with
//     redelivery.WithDirectSettle, by one goroutine per delivery that watches the message's
//     Acked and Nacked channels otherwise; an ack or nack given before a delivery ends counts;
//   - nack holds (Options.HoldNacks), for a broker that cannot delay a redelivery;
//   - the end of a subscription (its Subscribe context ends, the Group closes, or Fetch
//     fails): it stops fetching, tells the source how every delivery it held ended, closes the
//     source and then the channel, within Options.CloseTimeout;
//   - the lifecycle of a Subscriber (Group): ErrClosed, and one idempotent Close;
//   - the common settings, validated and defaulted once (Rules).
//
// The package is internal to broker/: its API changes with the schemes that use it, and no
// user needs it to write a subscriber of their own (broker/redelivery is that contract).
//
// # A source
//
// A scheme's Subscribe builds its source, makes the engine with New (the source keeps the
// *Subscription, to Emit, End and Hurry) and starts it in the Subscriber's Group:
//
//	src := &source{...}
//	src.sub = inflight.New(ctx, src, inflight.Options{...})
//	return src.sub.Start(s.group)
//
// The type parameter T is what the source keeps of each message to settle it (a delivery tag,
// a stream entry id, the broker client's message); the engine carries it in Delivery.Data.
//
// Fetch(ctx, n) runs in the subscription's fetch goroutine, one call at a time, when n places
// of the window are free. It takes up to n messages from the broker and passes each to Emit as
// it comes; it returns when its request is over (a pull request that expired, a read that
// returned, a poll with nothing new after its wait), and promptly when ctx ends. It handles
// the broker's transient failures itself: it logs, backs off (Subscription.Sleep) and
// reconnects, and returns an error only for a failure that ends the subscription. A Fetch
// that finds nothing waits for something (a blocking read, a poll interval) before it
// returns: the engine calls it again at once.
//
// Emit makes a message a delivery: its Item says the broker's delivery count and when the
// broker gives the message to another consumer (Deadline; zero for Options.AckTimeout from
// the hand-out, or for no deadline). Emit takes a place the fetch reserved, or a new one (the
// window may then exceed Prefetch for a moment: a message that came after its fetch). It never
// blocks. It returns nil once the subscription is stopping: the message is then the source's
// to give back (or to leave to the broker's own deadline). Emit may be called from any
// goroutine: a source that hands out in an order of its own (Kafka: a partition's records in
// offset order, a record alone) keeps its records in its own books until their turn and emits
// each then: Fetch keeps the places of what it booked (Keep), each later Emit with Item.Kept
// takes one, and Release gives back those of records it drops.
//
// Settle(d, o) runs once per delivery when it ends, with its Outcome: acked, nacked (with the
// delay to give the broker: Options.NackDelay or the one the consumer asked for), or neither;
// Cause nil when the consumer settled it, or why it ended first; and when the consumer took it
// (HandedOut: AMQP's acks measure processing times from it). It runs in the goroutine
// that ended the delivery: the consumer's (direct settlement), a watcher's, the timer's, the
// one that called End, or the one that stops the subscription. So it must not wait for the
// broker: it writes to a buffer (nats.go's), queues the ack for a coalescing writer (an XACK,
// a multiple basic.ack, an offset commit, a lease statement), or starts a goroutine. With
// Options.HoldNacks the engine holds a nack for its delay first, out of the window: Settle
// gets it once as the hold begins (Outcome.Held, with the whole delay: the source takes the
// delivery out of its books of deliveries in flight, a tag held in AMQP's window of acks),
// and again when it ends, with Delay 0 (or, when the subscription ends first, with the delay
// left and a Cause). With Options.LateAcks Settle also gets an ack given after its delivery ended
// (Outcome.Late): a lease nobody claimed since may still take it.
//
// End(cause, match) ends the deliveries in flight that match, held nacks included, as their
// broker dropped them: a lost connection (every delivery, or those of one link), a revoked
// partition, a delivery the broker superseded. Each gets Settle with cause and what the
// consumer gave before, in the goroutine that called End; a queued one is not handed out. A
// nack whose hold is beginning (its Settle with Outcome.Held running) is not among them: it
// ends with its hold, and its source, which knows that its broker dropped it, sends nothing.
// Withdraw(cause, match) is End for the matching deliveries that the consumer has not taken
// yet: a source that stops handing out some of its messages (Kafka's partition being revoked)
// takes back those still queued, and waits only for those the consumer has.
//
// Close(ctx) runs once, after Fetch has returned (or CloseTimeout has passed) and every
// delivery has had its Settle: it sends what the source still holds (coalesced acks), gives
// back to the broker in bulk what Settle could not (an XAUTOCLAIM-able entry, a lease row),
// and releases the subscription's own resources. The channel is closed after it returns: a
// consumer that sees it closed knows its acks are sent. Its error is what Group.Close reports.
//
// Optional hooks: a source that acts on several settlements together implements Flusher
// (redelivery.Flush: AMQP's ack coalescing sends its run of acks); one that puts values of its
// own in each delivery's context implements Contexter (a redelivery.TxAck).
//
// # Goroutines and locks
//
// A subscription runs two goroutines of its own, the fetch loop (Fetch) and the pump (the
// hand-out), one timer (deadlines and holds), and, for a consumer that does not settle
// directly, one watcher per delivery handed out. The engine holds its mutex only for its own
// books, never while it calls the source. So a source may call Emit, Hurry, Keep, Release and
// Delivery.HandedOut from any goroutine, its own locks held or not: the order is always the
// source's lock first, then the engine's. End is the exception: it calls Settle, so a source
// calls it without the locks its Settle takes.
//
// # The schemes
//
// Every scheme of broker/ is a source: mem (the smallest), redis, nats, amqp, kafka, sqlqueue
// and sqlitequeue. What each takes of the engine beyond Fetch, Settle and Close:
//
//   - amqp: RabbitMQ pushes (basic.qos is the window): Fetch waits for the first delivery of
//     the channel and takes the others that are there, up to n; a lost channel or connection
//     is End(ErrConnectionLost, every delivery of that session) and a new session inside
//     Fetch, and Settle sends nothing for a delivery whose session is gone (tags belong to
//     their channel). With HoldNacks, Settle marks a tag held as its hold begins
//     (Outcome.Held) and nacks it when it ends. The coalescer is the source's: Settle records
//     an ack under the session's mutex and sends the frames it returns, measuring processing
//     times from Outcome.HandedOut; Flusher sends the run of acks at the front; the session
//     keeps its own ack timer. The settlements of the end are sent in Close, after the
//     consumer is cancelled. Item.Count is the quorum queue's count, Item.Redelivered the
//     classic queue's flag; no deadline.
//   - kafka: the books, the per-partition order and the hand-out gate are the source's: Fetch
//     polls and books, Keep keeps a place for each record booked (the records it could not
//     keep a place for take a new one when emitted), and the source's hand-out goroutine
//     Emits a record (Item.Kept, under the source's mutex) when its turn comes, after the
//     metadata commit that records the hand-out. Options.AckTimeout (Item.Deadline zero)
//     counts from the hand-out. With HoldNacks, Settle takes a held nack out of the
//     deliveries in flight as its hold begins (a revoke does not wait for it; in order, the
//     records behind it wait for its redelivery) and queues the record again when it ends. A
//     revoke Withdraws the partition's deliveries its consumer has not taken, waits for the
//     others, commits, drops the partition's books, Releases their places and then calls
//     End(ErrRevoked, the partition's deliveries); the final commit and the leave are Close.
//   - sqlqueue: LateAcks (a late ack still deletes the lease nobody claimed since), Contexter
//     for the redelivery.TxAck, the lease as Item.Deadline, the settler's batches behind
//     Settle, its seal in Close. A delivery given back at the end that was never handed out
//     (Delivery.HandedOut) gets its count back.
//   - sqlitequeue: as sqlqueue, with its claim rows as the leases.
//
// The engine's tests cover the window, the hand-out, settlement and the contexts once; a
// scheme's tests cover its own frames, counts, reconnects and give-back, and its bench_test.go
// counts the allocations per message.
//
// # What the engine promises a consumer
//
// A delivery leaves the window once, by the first of: its settlement, its deadline, End, or
// the end of the subscription; a later Settle, Ack or Nack changes nothing (except a late ack
// with Options.LateAcks). An ack or nack given before a delivery ends counts, also when the
// engine sees it after. Once a subscription is stopping, the deliveries' contexts are
// cancelled at once, and their settlements wait for the end of Fetch: a source whose last
// request could still bring messages (a NATS pull request) withdraws it before the messages
// it held are given back, so that none goes straight back to it.
package inflight
