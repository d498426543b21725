package kafka

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// This file commits a subscription's progress to the group (commits), and reads back what the
// group committed, also where a member starts each partition it is assigned (startOffsets).

// groupOffset is what the group has committed for a partition.
type groupOffset struct {
	committed int64 // -1 for nothing
	md        groupMetadata
	// described is set when md is onceflow's (parseMetadata): its taken offset says what a
	// member handed out.
	described bool
}

// takenAtLeast is the least taken offset of g's partition: the record at the committed offset
// counts as handed out once when the commit's metadata is not onceflow's (another client may
// have been delivering it), not when it is (its taken offset says).
func (g groupOffset) takenAtLeast() int64 {
	if g.described {
		return g.committed
	}
	return g.committed + 1
}

// groupOffsets fetches the group's committed offsets and metadata of the partitions ids. On
// failure it falls back to what the client fetched when the partitions were assigned, without
// metadata.
func (sub *subscription) groupOffsets(ctx context.Context, ids []int32) map[int32]groupOffset {
	ctx, cancel := context.WithTimeout(ctx, commitTimeout)
	defer cancel()
	out, err := fetchGroupOffsets(ctx, sub.adm, sub.s.cfg.ConsumerGroup, sub.topic, ids)
	if err != nil {
		sub.logger.Error("Cannot fetch the group's offsets: counting as redelivered only the record at each committed offset", err, nil)
		out = map[int32]groupOffset{}
		for p, eo := range sub.cl.CommittedOffsets()[sub.topic] {
			out[p] = groupOffset{committed: eo.Offset}
		}
	}
	return out
}

// fetchGroupOffsets returns what group has committed for the partitions parts of topic: -1,
// without metadata, for a partition without a commit.
func fetchGroupOffsets(ctx context.Context, adm *kadm.Client, group, topic string, parts []int32) (map[int32]groupOffset, error) {
	resp, err := adm.FetchOffsetsForTopics(ctx, group, topic)
	if err == nil {
		err = resp.Error()
	}
	if errors.Is(err, kerr.GroupIDNotFound) {
		// Some brokers (kfake) answer so for a group that has neither members nor commits;
		// Kafka answers with no offsets.
		resp, err = nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("fetch the offsets of consumer group %q: %w", group, err)
	}
	out := map[int32]groupOffset{}
	for _, p := range parts {
		g := groupOffset{committed: -1}
		if o, ok := resp.Lookup(topic, p); ok && o.At >= 0 {
			g.committed = o.At
			g.md, g.described = parseMetadata(o.Metadata)
		}
		out[p] = g
	}
	return out, nil
}

// startOffsets is kgo's AdjustFetchOffsetsFn of a subscription whose consumer gave its
// positions: each partition assigned starts after the offset the consumer applied last there,
// when the group's committed offset is below it. When the positions cannot be read, the
// partitions start at the committed offsets: the consumer's duplicate detection absorbs that.
func (sub *subscription) startOffsets(ctx context.Context, offsets map[string]map[int32]kgo.Offset) (map[string]map[int32]kgo.Offset, error) {
	parts := offsets[sub.topic]
	if len(parts) == 0 {
		return offsets, nil
	}
	ctx, cancel := context.WithTimeout(ctx, commitTimeout)
	defer cancel()
	applied, err := sub.positions.Applied(ctx, sub.topic)
	if err != nil {
		sub.logger.Error("Cannot read the consumer's positions: its partitions start at the group's committed offsets", err, nil)
		return offsets, nil
	}
	for id, o := range parts {
		// A partition without a commit starts at its first record: an offset below 0.
		if a, ok := applied[id]; ok && o.EpochOffset().Offset <= a {
			parts[id] = kgo.NewOffset().At(a + 1)
		}
	}
	return offsets, nil
}

// commits commits the marks as they move, until the subscription begins to stop.
func (sub *subscription) commits() {
	stop := sub.sub.Context()
	for {
		select {
		case <-sub.commit:
		case <-stop.Done():
			return
		}
		ctx, cancel := context.WithTimeout(stop, commitTimeout)
		sub.commitMu.Lock()
		err := sub.commitLocked(ctx, nil, false)
		sub.commitMu.Unlock()
		cancel()
		if err != nil && stop.Err() == nil {
			sub.logger.Error("Offset commit failed; retrying", err, nil)
			if !inflight.Pause(stop.Done(), retryPause) {
				return
			}
			inflight.Signal(sub.commit)
		}
	}
}

// commitLocked commits the marks and the taken offsets that moved of the partitions ids (all
// when ids is nil), and hands out the records that the new taken offsets cover. final is set
// for the last commit of partitions the member gives up, whose deliveries have all ended: its
// taken offset is what the consumer took (partition.takenFinal), not what the member readied.
// sub.commitMu is held.
func (sub *subscription) commitLocked(ctx context.Context, ids []int32, final bool) error {
	sub.mu.Lock()
	parts := sub.partsLocked(ids)
	commits := map[int32]commit{}
	for _, p := range parts {
		taken := max(p.want, p.unknownUntil, p.horizon)
		if final {
			taken = p.takenFinal()
		}
		c := commit{mark: p.mark(), md: groupMetadata{taken: taken}, acks: p.acks}
		counts, grew := p.counts()
		if c.mark.Offset > p.committed || c.md.taken != p.horizon || c.acks > p.ackCommitted || grew {
			c.md.acked, c.md.counts = p.spans(), counts
			commits[p.id] = c
		}
	}
	topicID := sub.topicID
	sub.mu.Unlock()
	if len(commits) == 0 {
		return nil
	}
	if err := commitAsMember(ctx, sub.cl, sub.s.cfg.ConsumerGroup, sub.topic, topicID, commits); err != nil {
		return err
	}
	sub.mu.Lock()
	defer sub.mu.Unlock()
	queued := false
	for _, p := range parts {
		c, ok := commits[p.id]
		if !ok || p.gone {
			continue
		}
		p.committed = max(p.committed, c.mark.Offset)
		p.horizon = max(p.horizon, c.md.taken)
		p.ackCommitted = max(p.ackCommitted, c.acks)
		for _, e := range p.entries {
			if n, ok := c.md.counts[e.offset]; ok {
				e.recorded = max(e.recorded, n)
			}
		}
		if p.revoking {
			continue
		}
		if c.md.taken > p.horizon-1 {
			queued = true // the sender may wait for it
		}
		p.pending = slices.DeleteFunc(p.pending, func(d *delivery) bool {
			if !p.ready(d.e) {
				return false
			}
			d.e.waiting = false
			queued = sub.readyLocked(d) || queued
			return true
		})
	}
	if queued || sub.gated {
		sub.pumpLocked()
	}
	return nil
}

// partsLocked returns the partitions ids in the books (all when ids is nil). sub.mu is held.
func (sub *subscription) partsLocked(ids []int32) []*partition {
	if ids == nil {
		return slices.Collect(maps.Values(sub.parts))
	}
	var parts []*partition
	for _, id := range ids {
		if p := sub.parts[id]; p != nil {
			parts = append(parts, p)
		}
	}
	return parts
}

// commit is what one offset commit says of a partition.
type commit struct {
	mark kgo.EpochOffset
	md   groupMetadata
	acks int // p.acks when it was made
}

// commitAsMember commits, for group, the marks of topic's partitions with their metadata, as
// cl's member of the group in its current generation, and waits for the reply. A commit that
// the group refuses (a rebalance is under way, the member left) changes nothing.
func commitAsMember(ctx context.Context, cl *kgo.Client, group, topic string, topicID [16]byte, commits map[int32]commit) error {
	member, generation := cl.GroupMetadata()
	if member == "" {
		return errors.New("kafka: commit: not a member of the group yet")
	}
	req := kmsg.NewPtrOffsetCommitRequest()
	req.Group = group
	req.MemberID = member
	req.Generation = generation
	t := kmsg.NewOffsetCommitRequestTopic()
	t.Topic = topic
	t.TopicID = topicID
	for id, c := range commits {
		rp := kmsg.NewOffsetCommitRequestTopicPartition()
		rp.Partition = id
		rp.Offset = c.mark.Offset
		rp.LeaderEpoch = c.mark.Epoch
		md := c.md.encode()
		rp.Metadata = &md
		t.Partitions = append(t.Partitions, rp)
	}
	req.Topics = append(req.Topics, t)
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return err
	}
	for _, rt := range resp.Topics {
		for _, rp := range rt.Partitions {
			if err := kerr.ErrorForCode(rp.ErrorCode); err != nil {
				return fmt.Errorf("kafka: commit partition %d: %w", rp.Partition, err)
			}
		}
	}
	return nil
}
