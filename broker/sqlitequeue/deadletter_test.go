package sqlitequeue_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/messagedata"
)

// A dead letter is stored once per topic and key within broker.DeadLetterKeyWindow: the same
// key on another topic is stored, and so is the same key once its first publish is older than
// the window (a message its producer sent again long after), whose old key is deleted.
func TestPublish_DeadLetterIsStoredOncePerTopicAndKeyWithinTheWindow(t *testing.T) {
	q := setup(t, sqlitequeue.Config{})
	pub := q.Publisher()
	t.Cleanup(func() { require.NoError(t, pub.Close()) })
	dead := func(uuid, key string) *message.Message {
		m := message.NewMessage(uuid, []byte("x"))
		m.Metadata.Set(messagedata.HeaderDeadLetterKey, key)
		return m
	}
	ctx := context.Background()
	length := func(topic string) int64 {
		t.Helper()
		n, err := q.Len(ctx, topic)
		require.NoError(t, err)
		return n
	}
	require.NoError(t, pub.Publish("dead", dead("a", "k1"), message.NewMessage("plain", []byte("x"))))
	require.NoError(t, pub.Publish("dead", dead("a", "k1")))
	require.NoError(t, pub.Publish("other", dead("a", "k1")))
	require.Equal(t, int64(2), length("dead"), "the dead letter once, and the message without a key")
	require.Equal(t, int64(1), length("other"))

	// The first publish of k1 on "dead" is older than the window now.
	_, err := q.DB().ExecContext(ctx, `UPDATE `+sqlitequeue.DeadLetterKeysTable+` SET published_at = ? WHERE topic = 'dead'`,
		time.Now().Add(-broker.DeadLetterKeyWindow-time.Minute).UnixMilli())
	require.NoError(t, err)
	require.NoError(t, pub.Publish("dead", dead("a", "k1")))
	require.Equal(t, int64(3), length("dead"), "a dead letter of the key after the window is stored")
	require.NoError(t, pub.Publish("dead", dead("a", "k1")))
	require.Equal(t, int64(3), length("dead"), "and remembered for the window again")
	var keys int
	require.NoError(t, q.DB().QueryRowContext(ctx, `SELECT count(*) FROM `+sqlitequeue.DeadLetterKeysTable).Scan(&keys))
	require.Equal(t, 2, keys, "k1 on each topic, once")
}
