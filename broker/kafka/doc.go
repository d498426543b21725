// Package kafka is onceflow's broker for Apache Kafka, on franz-go's kgo client: a watermill
// message.Publisher (kgo's idempotent producer) and a message.Subscriber that keeps many
// records in flight per subscription and commits offsets only below the records acked. It
// registers the kafka:// scheme of broker.Open when a program imports it:
//
//	import _ "github.com/onceflow/onceflow/broker/kafka"
//
// A message is one record (Record and Message say how each is made from the other). Topics are
// created when a publisher or subscriber finds them missing (Topics).
//
// # Consumer groups, acks and commits
//
// Each Subscribe call is one member of Config.ConsumerGroup, with a client of its own,
// consuming one topic; the group's members share the topic's partitions, and every group gets
// every record. A subscription polls records ahead of their acknowledgements
// (Config.Prefetch) and hands them out, from every partition it owns, once the group's
// metadata records them (see Delivery counts). Kafka's commits are positions: for each
// partition the subscription commits the offset of the first record not acked (or the offset
// after the last record taken, when all are), as acks arrive, one commit at a time for all
// partitions. A record acked behind one that is not stays uncommitted until that one is.
//
// A nacked record (Config.NackDelay), or one whose delivery outlived Config.AckTimeout, is
// handed out again by the same subscription while the records behind it go on, and holds back
// its partition's commits until it is acked: records are not handed out in offset order once
// one is nacked. Each message says where it sits (messagedata.Position): its partition, its
// offset, and the last record before it in the partition not acked when it was handed out,
// which the consumer must apply first.
//
// # In order, from the consumer's positions
//
// A consumer that detects duplicates by offset (Handler.Dedup.Mode DedupByOffset) subscribes
// with its applied offsets (redelivery.WithPositions). A partition assigned to the member then
// starts after the offset applied there when the group has committed less (a new group, a
// commit lost in a crash), and the group's committed offset follows the acks, for lag
// monitoring. A partition's records are handed out in offset order, one at a time: the next
// once the one before is acked, a nacked record again (after its delay) before the records
// behind it; records of different partitions still run at once. With
// redelivery.WithPositionWindow (group commit with DedupByOffset) a partition's records are
// handed out several at once, up to Prefetch, in offset order, each once every record before
// it that is not acked is handed out; a redelivery still waits until every record before it is
// acked, and the records after a nacked one wait for it.
//
// # Delivery counts
//
// Kafka keeps no delivery count: before it hands a record out, the subscription commits in
// the group's offset metadata (metadata.go) that the record was taken (a first delivery) or
// how many times it was handed out (a redelivery). The Count of redelivery.Info therefore goes
// on across members, restarts and crashes. A member records a record as taken a little
// before its consumer takes it; when the member gives the partition up (a revoke, Close), its
// last commit records only what the consumer took. After a crash, a record that the member had
// taken counts as handed out once: a count may be one too high, never too low; such a record
// is handed out alone (see pumpLocked). A group whose offsets another client committed has no
// such metadata: the record at the committed offset counts as handed out once. The metadata
// also lists the records acked behind one that is not: the next owner does not deliver them
// again.
//
// # Rebalances and Close
//
// When the group takes partitions away from a member, the member stops handing out their
// records (those its consumer has not taken yet go back at once), waits for the deliveries its
// consumer has (Config.RevokeTimeout), commits what is acked of them, and ends the others
// (ErrRevoked): their new owner delivers them again from the committed offset. A member whose
// session expires (Config.SessionTimeout) loses its partitions without a commit. Close (or the
// end of a Subscribe context) stops polling, commits what is acked within Config.CloseTimeout,
// and leaves the group, so that its partitions move at once.
package kafka
