package broker_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/sqldb"
)

// dropsDeadLetterCopies are the schemes that store a dead letter published again under its key
// (messagedata.HeaderDeadLetterKey) once: the SQLite and SQL queues within an hour, NATS within the
// stream's duplicate window. The others store each publish.
var dropsDeadLetterCopies = map[string]bool{"sqlite": true, "nats": true, "postgres": true, "mysql": true}

// A dead letter published again with its key (the next consumer publishes it again when its
// predecessor died between the publish and the router's record of it) is stored once where the
// broker can tell, with the content of the first publish; a dead letter of the same message
// under another key (dead-lettered again after a replay) is stored as well, and so is a second
// copy within one Publish call only once.
func TestBroker_DeadLetterPublishedAgainUnderItsKey(t *testing.T) {
	t.Parallel()
	forEachInspectableScheme(t, func(t *testing.T, f *fixture) {
		b := f.open(broker.Options{})
		deadLetter := func(key, at string) *message.Message {
			m := f.message(1)
			m.Metadata.Set(messagedata.HeaderDeadLetterHandler, "billing")
			m.Metadata.Set(messagedata.HeaderDeadLetterTime, at)
			m.Metadata.Set(messagedata.HeaderDeadLetterKey, key)
			return m
		}
		f.publish(b, deadLetter("first", "2026-01-01T00:00:00Z"))
		f.publish(b, deadLetter("first", "2026-01-01T00:00:01Z")) // published again after a death
		f.publish(b, deadLetter("replayed", "2026-01-01T00:00:05Z"))
		require.NoError(t, b.Publisher().Publish(f.topic, deadLetter("batch", "2026-01-01T00:00:06Z"), deadLetter("batch", "2026-01-01T00:00:07Z")))

		got := peek(t, b, f.topic, 10)
		times := make([]string, len(got))
		for i, m := range got {
			times[i] = m.Metadata.Get(messagedata.HeaderDeadLetterTime)
			require.Equal(t, f.message(1).UUID, m.UUID)
		}
		if dropsDeadLetterCopies[f.sc.name] {
			require.Equal(t, []string{"2026-01-01T00:00:00Z", "2026-01-01T00:00:05Z", "2026-01-01T00:00:06Z"}, times, "one dead letter per key, the first")
			return
		}
		require.Len(t, got, 5, "%s stores every publish", f.sc.name)
	})
}

// The SQL and SQLite queues remember a dead letter's key for broker.DeadLetterKeyWindow: a dead
// letter of the key published later (a message its producer sent again long after) is stored.
func TestBroker_DeadLetterKeyIsForgottenAfterTheWindow(t *testing.T) {
	t.Parallel()
	for _, sc := range schemes() {
		if sc.name != "sqlite" && sc.name != "postgres" && sc.name != "mysql" {
			continue
		}
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			f := setup(t, sc, testTimings)
			b := f.open(broker.Options{})
			dead := f.message(1)
			dead.Metadata.Set(messagedata.HeaderDeadLetterKey, "k-"+f.topic)
			f.publish(b, dead)
			f.publish(b, dead)
			require.Len(t, peek(t, b, f.topic, 10), 1)

			db, err := sqldb.Open(context.Background(), f.raw)
			require.NoError(t, err)
			t.Cleanup(func() { _ = db.Close() })
			_, err = db.ExecContext(context.Background(), db.Rebind(`UPDATE onceflow_dead_letter_keys SET published_at = ? WHERE topic = ?`),
				time.Now().Add(-broker.DeadLetterKeyWindow-time.Minute).UnixMilli(), f.topic)
			require.NoError(t, err)
			f.publish(b, dead)
			f.publish(b, dead)
			require.Len(t, peek(t, b, f.topic, 10), 2, "stored again once after the window, then remembered")
		})
	}
}
