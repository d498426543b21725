package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/kafkatest"
)

// dlq list and replay on Kafka, through the command, against an in-process cluster: the
// router of the group consumes its topic while replay joins the group to take the dead
// letters out of the dead-letter topic for it.
func TestDLQ_KafkaListAndReplayDeadLettersExactlyOnce(t *testing.T) {
	t.Parallel()
	f := setupDLQ(t, dlqBroker{name: "kafka", url: func(t testing.TB) string { return kafkatest.URL(t, "partitions=1") }})
	f.publish("good-1", `{"n": 1}`)
	f.publish("bad-1", `not json 1`)
	f.publish("bad-2", `not json, 2`)
	f.waitApplied(map[string]int{"good-1": 1})
	f.waitDeadLetters(2)

	rep := f.list()
	require.ElementsMatch(t, []string{"bad-1", "bad-2"}, ids(rep.DeadLetters))
	require.Equal(t, "billing", rep.Group)
	for _, d := range rep.DeadLetters {
		require.Equal(t, f.topic, d.Topic)
		require.Equal(t, f.handler, d.Handler)
		require.Contains(t, d.Reason, "is not JSON")
	}
	require.Equal(t, ids(rep.DeadLetters), ids(f.list().DeadLetters), "listing consumed nothing")

	f.fixed.Store(true)
	rr := f.replay("--id", "bad-1")
	require.Equal(t, []string{"bad-1"}, []string{rr.Replayed[0].ID})
	require.Len(t, rr.Replayed, 1)
	require.Len(t, rr.Kept, 1)
	require.Equal(t, []string{"bad-2"}, ids(f.list().DeadLetters))
	f.waitApplied(map[string]int{"good-1": 1, "bad-1": 1})

	rr = f.replay("--all")
	require.Equal(t, []string{"bad-2"}, []string{rr.Replayed[0].ID})
	require.Len(t, rr.Replayed, 1)
	require.Empty(t, rr.Kept)
	require.Empty(t, f.list().DeadLetters)
	f.waitApplied(map[string]int{"good-1": 1, "bad-1": 1, "bad-2": 1})
	require.Zero(t, f.duplicates())
}
