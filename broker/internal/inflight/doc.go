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
//     the broker cannot delay), cancelled when the delivery ends, with the cause; it lives in
//     the Delivery, one allocation for both, and makes a context of the context package only
//     when one is needed (context.go);
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
// Emit makes a message a delivery (Item, Subscription.Emit). A source that hands out in an
// order of its own (Kafka: a partition's records in offset order) keeps its records in its
// own books until their turn and emits each then, in the places Fetch kept for them (Keep,
// Item.Kept, Release).
//
// Settle(d, o) runs once per delivery when it ends, with its Outcome, in the goroutine that
// ended the delivery: the consumer's (direct settlement), a watcher's, the timer's, the one
// that called End, or the one that stops the subscription. So it must not wait for the
// broker: it writes to a buffer (nats.go's), queues the ack for a coalescing writer (a Writer:
// an XACK, a lease statement; or the source's own: a multiple basic.ack, an offset commit), or
// starts a goroutine. With Options.HoldNacks it learns of a nack twice, as its hold begins
// (Outcome.Held) and as it ends; with Options.LateAcks, of an ack given after its delivery
// ended (Outcome.Late).
//
// End(cause, match) ends the deliveries that the broker dropped (a lost connection, a revoked
// partition, a delivery the broker superseded), and Withdraw those the consumer has not taken
// yet (a source that stops handing out some of its messages).
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
// Every scheme of broker/ is a source; its source type's doc says what it takes of the engine
// beyond Fetch, Settle and Close:
//
//   - mem, the smallest: nothing more;
//   - redis: a Writer of XACKs, Item.Deadline from the read, End for a lost connection and
//     for a delivery its entry's new claim superseded;
//   - nats: Item.Deadline from the consumer's AckWait, End for a lost connection;
//   - amqp: HoldNacks, Flusher, its own coalescer of acks, End for a lost channel;
//   - kafka: Keep, Item.Kept and Release for its own order, HoldNacks, Withdraw and End for a
//     revoked partition;
//   - sqlqueue: LateAcks, Contexter (a redelivery.TxAck), the lease as Item.Deadline, a Writer;
//   - sqlitequeue: as sqlqueue, its settlements committed by its topic's next transaction.
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
