package conformance

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
)

// This file reads what became of the Poison scenario's messages: effects, latencies and dead
// letters.

// renamed returns copies of ms with ids that no earlier run used.
func renamed(ms []poisonMessage, run int) []poisonMessage {
	out := slices.Clone(ms)
	for i := range out {
		out[i].id = fmt.Sprintf("%s-run%d", out[i].id, run)
	}
	return out
}

// slowest describes the five slowest good messages of each handler, and the deaths of the
// poison handler's consumers, in milliseconds since start, for failure messages.
func (f *fixture) slowest(published map[string]map[string]time.Time, start time.Time, baseName, name string, pz *pool) string {
	var b strings.Builder
	ms := func(t time.Time) int64 { return t.Sub(start).Milliseconds() }
	for _, h := range []string{baseName, name} {
		var rows []struct {
			ID        string `db:"message_id"`
			AppliedAt int64  `db:"applied_at"`
		}
		_ = f.db.Select(&rows, f.db.Rebind(`SELECT message_id, applied_at FROM `+poisonTable+` WHERE handler = ?`), h)
		slices.SortFunc(rows, func(a, b struct {
			ID        string `db:"message_id"`
			AppliedAt int64  `db:"applied_at"`
		}) int {
			return int(time.UnixMicro(b.AppliedAt).Sub(published[h][b.ID]) - time.UnixMicro(a.AppliedAt).Sub(published[h][a.ID]))
		})
		fmt.Fprintf(&b, "%s:", h)
		for _, r := range rows[:min(5, len(rows))] {
			fmt.Fprintf(&b, " %s published %d applied %d;", r.ID, ms(published[h][r.ID]), ms(time.UnixMicro(r.AppliedAt)))
		}
		b.WriteString(" ")
	}
	pz.mu.Lock()
	defer pz.mu.Unlock()
	b.WriteString("deaths:")
	for _, d := range pz.died {
		fmt.Fprintf(&b, " %d", ms(d))
	}
	return b.String()
}

// publishLong publishes the message with a long id to topic, through Features.LongIDProducer
// or else the broker's publisher, and reports the broker's refusal.
func (f *fixture) publishLong(b *broker.Broker, topic, id, payload string) error {
	if f.features.LongIDProducer != nil {
		f.features.LongIDProducer(f.t, f.brokerURL, topic, id, []byte(payload))
		return nil
	}
	return b.Publisher().Publish(topic, message.NewMessage(id, []byte(payload)))
}

// poisonDistinct returns the number of good messages with an effect in handler.
func (f *fixture) poisonDistinct(handler string) int {
	f.t.Helper()
	var n int
	require.NoError(f.t, f.db.Get(&n, f.db.Rebind(`SELECT COUNT(DISTINCT message_id) FROM `+poisonTable+` WHERE handler = ?`), handler))
	return n
}

// poisonCounts returns the number of effects of each message in handler.
func (f *fixture) poisonCounts(handler string) map[string]int {
	return f.countsIn(poisonTable, handler)
}

// poisonLatencies returns, for each message of handler published at published[id] and kept by
// keep (nil keeps all), the time from its publish to the write of its effect, sorted.
func (f *fixture) poisonLatencies(handler string, published map[string]time.Time, keep func(id string) bool) []time.Duration {
	f.t.Helper()
	var rows []struct {
		ID        string `db:"message_id"`
		AppliedAt int64  `db:"applied_at"`
	}
	require.NoError(f.t, f.db.Select(&rows, f.db.Rebind(`SELECT message_id, applied_at FROM `+poisonTable+` WHERE handler = ?`), handler))
	out := make([]time.Duration, 0, len(rows))
	for _, r := range rows {
		at, ok := published[r.ID]
		require.True(f.t, ok, "%s: effect of a message that was not published: %q", handler, r.ID)
		if keep == nil || keep(r.ID) {
			out = append(out, time.UnixMicro(r.AppliedAt).Sub(at))
		}
	}
	slices.Sort(out)
	return out
}

// percentile returns the q-quantile of sorted, by the nearest-rank method: the p99 of 200
// values is the 198th.
func percentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(q*float64(len(sorted)) + 0.999999)
	return sorted[min(max(rank, 1), len(sorted))-1].Round(100 * time.Microsecond)
}

func ids(ms []poisonMessage) []string {
	out := make([]string, len(ms))
	for i, m := range ms {
		out[i] = m.id
	}
	return out
}

// dlKinds describes the dead letters of each poison message, for failure messages.
func dlKinds(poison []poisonMessage, dls map[string][]*message.Message) map[string]int {
	out := map[string]int{}
	for _, pm := range poison {
		out[pm.kind] = len(dls[pm.id])
	}
	extra := 0
	for id, ms := range dls {
		if !slices.ContainsFunc(poison, func(pm poisonMessage) bool { return pm.id == id }) {
			extra += len(ms)
		}
	}
	if extra > 0 {
		out["others"] = extra
	}
	return out
}
