package onceflow_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// publishAt publishes a message that its subscriber says is at offset of partition 0, after
// prev, as a Kafka subscriber does.
func (f *fixture) publishAt(t *testing.T, id string, offset, prev int64) {
	t.Helper()
	m := message.NewMessage(id, []byte("at"))
	for k, v := range (messagedata.Position{Offset: offset, Previous: prev}).Headers() {
		m.Metadata.Set(k, v)
	}
	require.NoError(t, f.broker.Publish(topic, m))
}

func TestExactlyOnceByOffset_OffsetAppliedOnceWhateverTheID(t *testing.T) {
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		f := newFixture(t, d)
		f.startRouter(t, onceflow.Handler{QoS: onceflow.ExactlyOnce, Dedup: middleware.Dedup{Mode: middleware.DedupByOffset}})

		f.publishAt(t, "a", 0, -1)
		f.waitAcks(t, "a", 1)
		f.publishAt(t, "b", 1, 0)
		f.waitAcks(t, "b", 1)
		// Offset 1 again, as after a rebalance, under another id: a duplicate by position.
		f.publishAt(t, "b-again", 1, 0)
		f.waitAcks(t, "b-again", 1)

		require.Equal(t, 1, countEffects(t, f.db, "a"))
		require.Equal(t, 1, countEffects(t, f.db, "b"))
		require.Zero(t, countEffects(t, f.db, "b-again"), "offset 1 was applied already")
		var dedupRows int
		require.NoError(t, f.db.Get(&dedupRows, `SELECT COUNT(*) FROM onceflow_positions WHERE handler = 'effects'`))
		require.Equal(t, 1, dedupRows, "one row for the partition, none per message")
	})
}

func TestExactlyOnceByOffset_MessageWithoutAPositionIsDeadLettered(t *testing.T) {
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		f := newFixture(t, d)
		f.startRouter(t, onceflow.Handler{QoS: onceflow.ExactlyOnce, Dedup: middleware.Dedup{Mode: middleware.DedupByOffset}})
		f.publish(t, "plain", "x")
		f.waitAcks(t, "plain", 1)
		require.Zero(t, countEffects(t, f.db, "plain"))
		dead := f.broker.Drain(onceflow.DefaultDeadLetterTopic)
		require.Len(t, dead, 1)
		require.Contains(t, dead[0].Metadata.Get(messagedata.HeaderDeadLetterReason), "message has no position in an ordered log")
	})
}

func TestExactlyOnceByOffset_InvalidCombinationsFailAtAddHandler(t *testing.T) {
	f := newFixture(t, testsvc.Databases()[0])
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: f.broker, PurgeInterval: -1})
	require.NoError(t, err)
	base := onceflow.Handler{Name: "h", Topic: topic, DB: f.db, Subscriber: f.broker.Subscriber(), Processor: processor.Func(applyEffect),
		Dedup: middleware.Dedup{Mode: middleware.DedupByOffset}}
	for _, tc := range []struct {
		edit func(h *onceflow.Handler)
		want string
	}{
		{func(h *onceflow.Handler) { h.QoS = onceflow.AtLeastOnce }, "Handler.Dedup.Mode: set, but the chain of AtLeastOnce has no deduplicate stage"},
		{func(h *onceflow.Handler) { h.QoS = onceflow.ExactlyOnceInOrder }, "Handler.Dedup.Mode: DedupByOffset applies to the ExactlyOnce chain"},
		{func(h *onceflow.Handler) { h.QoS = onceflow.ExactlyOnce; h.Dedup.WithTimestamp = true },
			"Handler.Dedup.WithTimestamp: set, but DedupByOffset keeps no dedup table"},
	} {
		h := base
		tc.edit(&h)
		require.ErrorContains(t, r.AddHandler(h), tc.want)
	}
}
