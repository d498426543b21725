package kafka

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/broker"
)

// A Kafka topic is an append-only log: what waits for a consumer group is what the group has
// not acked, the records from its committed offset on less those its commit metadata
// (metadata.go) says were acked past it. A view reads a topic from the group's committed
// offsets, skipping the acked spans, and takes a record out for the group by acking it as a
// member does: the record joins its partition's acked spans, and the committed offset moves
// past it when it is the first record not acked. Other groups are not touched.
//
// Kafka takes a group's commits only from its members while it has any, so the view joins the
// group (Claim) as a member subscribed to the topic alone (with kgo's cooperative-sticky
// assignment, the members that consume other topics keep their partitions), and waits until
// it owns every partition of the topic: taking a record out of a partition that a live member
// owns would race with that member's commits. Once the view owns them, the group fences the
// commits of older generations, and the member that takes them over when the view leaves
// reads the view's commit.

// claimTimeout bounds how long Claim waits for the topic's partitions, when the context has
// no earlier deadline: more than the rebalance timeout of onceflow's subscribers (25 s).
const claimTimeout = time.Minute

// viewRebalanceTimeout is the rebalance timeout of the view's member: it consumes nothing and
// rejoins at once.
const viewRebalanceTimeout = 10 * time.Second

// readIdle ends the reading of a partition whose last offsets hold no record the client
// returns (transaction markers, compacted records): after this long without a record, the
// partitions not read to their end are read as far as they go.
const readIdle = 2 * time.Second

// recordPos locates a record: broker.Entry.Pos of a Kafka view.
type recordPos struct {
	partition int32
	offset    int64
}

// view is a look at a topic for a consumer group (see above).
type view struct {
	opts    []kgo.Opt // the seed brokers and the dial timeout
	session time.Duration
	group   string
	topic   string
	cl      *kgo.Client // no group: metadata, offsets and reading
	adm     *kadm.Client
	id      [16]byte // the topic's id, for OffsetCommit v10
	parts   []int32  // the topic's partitions, sorted

	// starts are the partitions' log start offsets, as List read them: where a partition the
	// group has not committed starts.
	starts map[int32]int64

	// member is the view's member of the group, once Claim has joined it.
	member   *kgo.Client
	mu       sync.Mutex
	assigned map[int32]bool // whether the group gives member each partition of the topic
}

// newView opens views of topics for group. A topic that does not exist is an error wrapping
// broker.ErrNotFound; a group that has not committed offsets for the topic reads it from its
// start, as its members will.
func newView(opts []kgo.Opt, session time.Duration, group string) func(context.Context, string) (broker.View, error) {
	return func(ctx context.Context, topic string) (broker.View, error) {
		cl, err := kgo.NewClient(opts...)
		if err != nil {
			return nil, err
		}
		v := &view{opts: opts, session: session, group: group, topic: topic, cl: cl, adm: kadm.NewClient(cl)}
		if err := v.lookUp(ctx); err != nil {
			cl.Close()
			return nil, err
		}
		return v, nil
	}
}

// lookUp reads the topic's id and partitions.
func (v *view) lookUp(ctx context.Context) error {
	topics, err := v.adm.ListTopics(ctx, v.topic)
	if err != nil {
		return fmt.Errorf("look up topic %q: %w", v.topic, err)
	}
	td, ok := topics[v.topic]
	switch {
	case !ok || errors.Is(td.Err, kerr.UnknownTopicOrPartition):
		return broker.NotFound("topic", v.topic)
	case td.Err != nil:
		return fmt.Errorf("look up topic %q: %w", v.topic, td.Err)
	}
	v.id = td.ID
	v.parts = td.Partitions.Numbers()
	slices.Sort(v.parts)
	return nil
}

// Claim joins the group as a member that consumes the topic and fetches nothing, and waits
// until the group gives it every partition of the topic.
func (v *view) Claim(ctx context.Context) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, claimTimeout)
		defer cancel()
	}
	v.assigned = map[int32]bool{}
	track := func(add bool) func(context.Context, *kgo.Client, map[string][]int32) {
		return func(_ context.Context, _ *kgo.Client, parts map[string][]int32) {
			v.mu.Lock()
			defer v.mu.Unlock()
			for _, p := range parts[v.topic] {
				v.assigned[p] = add
			}
		}
	}
	opts := append(slices.Clip(v.opts),
		kgo.SessionTimeout(v.session), kgo.HeartbeatInterval(min(v.session/10, 3*time.Second)),
		kgo.RebalanceTimeout(viewRebalanceTimeout),
		kgo.ConsumerGroup(v.group),
		kgo.ConsumeTopics(v.topic),
		kgo.DisableAutoCommit(),
		kgo.OnPartitionsAssigned(track(true)),
		kgo.OnPartitionsRevoked(track(false)),
		kgo.OnPartitionsLost(track(false)),
	)
	member, err := kgo.NewClient(opts...)
	if err != nil {
		return fmt.Errorf("join consumer group %q: %w", v.group, err)
	}
	member.PauseFetchTopics(v.topic)
	v.member = member
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		if v.ownsAll() {
			return nil
		}
		if held := v.heldByOthers(ctx); len(held) > 0 {
			return fmt.Errorf("partitions %s of topic %q are assigned to another member of consumer group %q, which consumes the topic: Move and Delete take records out only of partitions that no member consumes (stop that consumer first)",
				strings.Join(held, ", "), v.topic, v.group)
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			return fmt.Errorf("consumer group %q did not give topic %q's partitions to a new member within the time allowed: %w", v.group, v.topic, context.Cause(ctx))
		}
	}
}

// ownsAll reports whether the group has given the view's member every partition of the topic.
func (v *view) ownsAll() bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, p := range v.parts {
		if !v.assigned[p] {
			return false
		}
	}
	return true
}

// heldByOthers returns the partitions of the topic that, in a stable group, other members hold.
func (v *view) heldByOthers(ctx context.Context) []string {
	me, _ := v.member.GroupMetadata()
	if me == "" {
		return nil // not a member yet: every member the group lists is another
	}
	groups, err := v.adm.DescribeGroups(ctx, v.group)
	if err != nil {
		return nil
	}
	g, ok := groups[v.group]
	if !ok || g.Err != nil || g.State != "Stable" {
		return nil
	}
	var held []string
	for _, m := range g.Members {
		a, ok := m.Assigned.AsConsumer()
		if m.MemberID == me || !ok {
			continue
		}
		for _, t := range a.Topics {
			if t.Topic == v.topic {
				for _, p := range t.Partitions {
					held = append(held, fmt.Sprint(p))
				}
			}
		}
	}
	return held
}

// List reads each partition from the group's committed offset (its start when the group has
// committed none) to its end when List starts, skipping the records acked past the committed
// offset, and returns up to limit records, oldest first: the partitions' records merged by
// timestamp, each partition's in offset order.
func (v *view) List(ctx context.Context, limit int) ([]broker.Entry, error) {
	starts, err := v.adm.ListStartOffsets(ctx, v.topic)
	if err == nil {
		err = starts.Error()
	}
	if err != nil {
		return nil, fmt.Errorf("list the start offsets of topic %q: %w", v.topic, err)
	}
	ends, err := v.adm.ListEndOffsets(ctx, v.topic)
	if err == nil {
		err = ends.Error()
	}
	if err != nil {
		return nil, fmt.Errorf("list the end offsets of topic %q: %w", v.topic, err)
	}
	committed, err := fetchGroupOffsets(ctx, v.adm, v.group, v.topic, v.parts)
	if err != nil {
		return nil, err
	}
	v.starts = map[int32]int64{}
	from, until := map[int32]kgo.Offset{}, map[int32]int64{}
	for _, p := range v.parts {
		s, _ := starts.Lookup(v.topic, p)
		e, _ := ends.Lookup(v.topic, p)
		v.starts[p] = s.Offset
		at := max(committed[p].committed, s.Offset)
		if at < e.Offset {
			from[p], until[p] = kgo.NewOffset().At(at), e.Offset
		}
	}
	if len(from) == 0 {
		return nil, nil
	}
	recs, err := v.read(ctx, from, until, committed, limit)
	if err != nil {
		return nil, err
	}
	var out []broker.Entry
	for len(out) < limit {
		var next int32 = -1
		for _, p := range v.parts {
			if len(recs[p]) > 0 && (next < 0 || recs[p][0].Timestamp.Before(recs[next][0].Timestamp)) {
				next = p
			}
		}
		if next < 0 {
			break
		}
		r := recs[next][0]
		recs[next] = recs[next][1:]
		out = append(out, broker.Entry{Message: Message(r), Pos: recordPos{r.Partition, r.Offset}})
	}
	return out, nil
}

// read returns, for each partition of from, up to limit of its records from from up to until,
// in offset order, less those in the acked spans of committed.
func (v *view) read(ctx context.Context, from map[int32]kgo.Offset, until map[int32]int64, committed map[int32]groupOffset, limit int) (map[int32][]*kgo.Record, error) {
	cl, err := kgo.NewClient(append(slices.Clip(v.opts),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{v.topic: from}),
		kgo.FetchMaxWait(200*time.Millisecond))...)
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	out := map[int32][]*kgo.Record{}
	left := len(from)
	idle := time.Now()
	for left > 0 && time.Since(idle) < readIdle {
		pollCtx, cancel := context.WithTimeout(ctx, readIdle)
		fetches := cl.PollFetches(pollCtx)
		cancel()
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		var ferr error
		fetches.EachError(func(_ string, p int32, err error) {
			if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
				ferr = fmt.Errorf("read partition %d of topic %q: %w", p, v.topic, err)
			}
		})
		if ferr != nil {
			return nil, ferr
		}
		fetches.EachRecord(func(r *kgo.Record) {
			end, reading := until[r.Partition]
			if !reading || r.Offset >= end {
				return
			}
			idle = time.Now()
			if !contains(committed[r.Partition].md.acked, r.Offset) {
				out[r.Partition] = append(out[r.Partition], r)
			}
			if r.Offset == end-1 || len(out[r.Partition]) == limit {
				delete(until, r.Partition)
				cl.PauseFetchPartitions(map[string][]int32{v.topic: {r.Partition}})
				left--
			}
		})
	}
	return out, nil
}

// Remove acks the record for the group (see above): it is in the acked spans of its
// partition's commit, or below the committed offset. A record acked already is left as it is.
func (v *view) Remove(ctx context.Context, e broker.Entry) error {
	pos := e.Pos.(recordPos)
	if v.member == nil {
		return errors.New("the view has not joined the consumer group (Claim)")
	}
	committed, err := fetchGroupOffsets(ctx, v.adm, v.group, v.topic, v.parts)
	if err != nil {
		return err
	}
	g, changed, err := ack(committed[pos.partition], v.starts[pos.partition], pos.offset)
	if err != nil || !changed {
		return err
	}
	// As the view's member of the group, in its generation.
	c := commit{mark: kgo.EpochOffset{Epoch: -1, Offset: g.committed}, md: g.md}
	if err := commitAsMember(ctx, v.member, v.group, v.topic, v.id, map[int32]commit{pos.partition: c}); err != nil {
		return fmt.Errorf("commit partition %d of topic %q for consumer group %q: %w", pos.partition, v.topic, v.group, err)
	}
	return nil
}

// ack returns g, the group's commit of a partition whose log starts at start, with the record
// at offset acked, and whether that changed it: the record joins the acked spans, and the
// committed offset moves past every acked record it reaches. The counts of the records acked
// go. A commit carries at most maxSpans spans: a record that would need more is an error.
func ack(g groupOffset, start, offset int64) (groupOffset, bool, error) {
	if g.committed >= 0 {
		// The metadata written now must still count what the commit read counts as taken.
		g.md.taken = max(g.md.taken, g.takenAtLeast())
	}
	// A group without a commit, or whose committed records the log no longer has, starts at
	// the log's start.
	g.committed = max(g.committed, start)
	if offset < g.committed || contains(g.md.acked, offset) {
		return g, false, nil
	}
	spans := slices.Clone(g.md.acked)
	i, _ := slices.BinarySearchFunc(spans, offset, func(s span, o int64) int { return cmp.Compare(s.from, o) })
	spans = slices.Insert(spans, i, span{offset, offset})
	merged := spans[:1]
	for _, s := range spans[1:] {
		if last := &merged[len(merged)-1]; s.from <= last.to+1 {
			last.to = max(last.to, s.to)
		} else {
			merged = append(merged, s)
		}
	}
	for len(merged) > 0 && merged[0].from <= g.committed {
		g.committed = max(g.committed, merged[0].to+1)
		merged = merged[1:]
	}
	if len(merged) > maxSpans {
		return g, false, fmt.Errorf("offset %d: the commit would hold %d spans of acked records past the committed offset %d, and carries at most %d; take out the records before them first",
			offset, len(merged), g.committed, maxSpans)
	}
	g.md.acked = merged
	g.md.taken = max(g.md.taken, g.committed)
	for o := range g.md.counts {
		if o < g.committed || contains(merged, o) {
			delete(g.md.counts, o)
		}
	}
	return g, true, nil
}

// Close leaves the group, if the view joined it, committing nothing more.
func (v *view) Close() error {
	if v.member != nil {
		v.member.Close()
	}
	v.cl.Close()
	return nil
}
