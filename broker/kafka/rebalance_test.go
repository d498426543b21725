package kafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	kafkabroker "github.com/onceflow/onceflow/broker/kafka"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// The group waits for a member to rejoin at a rebalance as long as the member's revoke can
// take, not kgo's 60 s: a member that neither rejoins nor lets its session lapse holds the
// group still that long at most. It needs a cluster it can watch, so it runs on kfake only.
func TestSubscriber_TheGroupWaitsForARejoinAsLongAsARevokeCanTake(t *testing.T) {
	t.Parallel()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "t"))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	joins := make(chan int32, 16)
	c.ControlKey(int16(kmsg.JoinGroup), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		select {
		case joins <- req.(*kmsg.JoinGroupRequest).RebalanceTimeoutMillis:
		default:
		}
		return nil, nil, false
	})
	s, err := kafkabroker.NewSubscriber(kafkabroker.Config{Brokers: c.ListenAddrs(), ConsumerGroup: testsvc.UniqueName("g"), RevokeTimeout: 2 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	_, err = s.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	select {
	case ms := <-joins:
		// RevokeTimeout, a commit in flight (10 s), the revoke's commit (CloseTimeout, 5 s by
		// default) and 5 s to rejoin.
		require.Equal(t, int32((2+10+5+5)*1000), ms)
	case <-time.After(within):
		t.Fatal("the member did not join the group")
	}
}
