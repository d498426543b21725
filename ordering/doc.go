// Package ordering is the ExactlyOnceInOrder quality of service: the messages of each ordering
// key are applied in the order of their sequence numbers, exactly once, although redeliveries,
// nacks and competing consumers deliver them in any order.
//
// # Producer side
//
// Each message carries an ordering key (an account, an order, an aggregate id) and its
// position among the messages of that key on its topic, 1, 2, 3, ..., in the headers
// onceflow_key and onceflow_seq (messagedata.HeaderKey, HeaderSequence). A Sequencer numbers
// them in the producer's transaction, gap-free, and Sequencer.Publish writes them to the
// transactional outbox in the same transaction, so that a message exists exactly when its
// number does:
//
//	seq, _ := ordering.NewSequencer(db, ordering.SequencerConfig{})
//	// in a handler's processor, or with PublishTx in a transaction of your own:
//	err := seq.Publish(ctx, ob, "postings", accountID, msg)
//
// SetSequence writes the headers directly, for producers that number messages themselves.
//
// # Consumer side
//
// InOrder.Middleware is the "in-order" interceptor of the router's ExactlyOnceInOrder chain,
// inside the transaction, after duplicate detection:
//
//	Tracing -> Metrics -> DeadLetter -> Recover -> Retry -> Timeout -> Transaction -> Deduplicate -> InOrder -> Processor
//
// (with group commit, the Transaction stage runs one transaction per group, which records the
// group's ids itself, and InOrder runs for each of its messages). For each message it locks the key's row in the state table and compares the message's sequence S
// with the last one applied, L:
//
//	S == L+1   apply it, then every parked message that now follows without a gap, in order,
//	           in the same transaction; record the new L
//	S <= L     a duplicate: acknowledged, not applied (a skipped S is dead-lettered instead)
//	S >  L+1   early: park it (id, headers, payload) and commit, so that it is acknowledged;
//	           it is applied when the gap before it fills
//
// The lock serialises the transactions of one key, on every consumer process sharing the
// database, while other keys go on in parallel; parking acknowledges an early message, so the
// broker does not redeliver it in a loop. Messages without key and sequence are refused
// (dead-lettered) unless Config.AllowUnkeyed.
//
// A parked message that fails when it is released is rolled back alone, to a savepoint: the
// message that released it commits, and the key stalls at the failing one until the sweeper
// retries it.
//
// # Gaps that do not fill
//
// InOrder.Run (the router starts it) sweeps every Config.SweepInterval, on one process at a
// time: it retries stalled keys, dead-letters a parked message that fails permanently, and
// reports a key that has waited longer than Config.GapTimeout (a log line and the
// onceflow.order.gap_timeouts counter), then applies Config.GapPolicy: Wait (the default) goes
// on waiting, Skip gives up on the missing sequences (recorded in the skipped table) and
// releases what follows, DeadLetter moves the key's parked messages to the dead-letter topic.
//
// # Storage
//
// Store.Migrate creates three tables, <Table>_state, <Table>_parked and <Table>_skipped
// (onceflow_order_* by default), keyed by handler and ordering key; Sequencer.Migrate creates
// the producer's onceflow_order_seq, keyed by topic and key. The state table has one row per
// key ever seen: a few dozen bytes each. Parked rows are deleted when applied.
package ordering
