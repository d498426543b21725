package nats_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	natsbroker "github.com/onceflow/onceflow/broker/nats"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// A pull request that the server drops without a word (NATS server 2.9 does so when a message
// comes at the moment the request expires, nats-server #3942) must cost nothing a user can
// see: the subscription asks again at about the request's expiry, not after its grace.
func TestSubscriber_APullRequestTheServerDropsDelaysNothing(t *testing.T) {
	f := setup(t)
	lost := natsbroker.LosePullEnds(t, 1)
	s := f.subscriber(natsbroker.Config{Prefetch: 4})
	ch := f.subscribe(s)
	select {
	case <-lost: // the first request expired, and the subscription did not hear it
	case <-time.After(within):
		t.Fatal("no pull request ended")
	}
	start := time.Now()
	f.publish(0, 1)
	m := testsvc.Receive(t, ch, within)
	require.Less(t, time.Since(start), 500*time.Millisecond, "the message waited for the lost request's grace")
	m.Ack()
}
