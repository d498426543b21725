package onceflow_test

import (
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
)

// A foreign producer's timestamp header is read in the forms producers write, and one that
// cannot be read counts as absent instead of dead-lettering the message. With the timestamp in
// the dedup key, every copy of a message maps to one key: each message is applied once, through
// an acknowledgement lost after its commit (a redelivery) and a copy sent again.
func TestExactlyOnce_ForeignTimestampsGiveEveryCopyOneKey(t *testing.T) {
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		f := newFixture(t, d)
		f.startRouter(t, onceflow.Handler{
			Chain: loseFirstAck(onceflow.ExactlyOnce),
			Dedup: middleware.Dedup{WithTimestamp: true},
		})

		now := time.Now().UTC()
		for _, tc := range []struct {
			id, header string
			key        int64 // the timestamp of the dedup key, in Unix microseconds
		}{
			{"go-unix", strconv.FormatInt(now.Unix(), 10), now.Unix() * 1e6},                                 // Go: time.Now().Unix()
			{"py-int", strconv.FormatInt(now.Unix(), 10), now.Unix() * 1e6},                                  // Python: int(time.time())
			{"py-iso", now.Format("2006-01-02T15:04:05.000000"), now.Truncate(time.Microsecond).UnixMicro()}, // Python: datetime.now().isoformat(), UTC
			{"js-millis", strconv.FormatInt(now.UnixMilli(), 10), now.UnixMilli() * 1e3},                     // JavaScript: Date.now()
			{"unreadable", "next tuesday", 0},
		} {
			m := message.NewMessage(tc.id, []byte(tc.id))
			m.Metadata.Set(messagedata.HeaderTimestamp, tc.header)
			require.NoError(t, f.broker.Publish(topic, m))
			f.waitAcks(t, tc.id, 1)
			require.NoError(t, f.broker.Publish(topic, m)) // the producer sends it again
			f.waitAcks(t, tc.id, 2)

			require.Equal(t, 1, f.broker.Nacks(tc.id), "%s: the lost acknowledgement", tc.id)
			require.Equal(t, 1, countEffects(t, f.db, tc.id), tc.id)
			var keys []int64
			require.NoError(t, f.db.Select(&keys, f.db.Rebind(`SELECT message_ts FROM onceflow_dedup WHERE message_id = ?`), tc.id))
			require.Equal(t, []int64{tc.key}, keys, tc.id)
		}
		require.Empty(t, f.broker.Drain(onceflow.DefaultDeadLetterTopic))
	})
}
