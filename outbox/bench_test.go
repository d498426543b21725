package outbox_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/outbox"
)

// counter is a destination that counts what it is given.
type counter struct{ n atomic.Int64 }

func (c *counter) Publish(_ string, msgs ...*message.Message) error {
	c.n.Add(int64(len(msgs)))
	return nil
}

func (c *counter) Close() error { return nil }

// BenchmarkRelay_DrainBacklog measures how fast one relay sends a backlog of 10,000 committed
// messages to a destination that takes each at once, per dialect: the relay's own cost
// (claims, settlements), not a broker's.
//
//	go test -run '^$' -bench BenchmarkRelay_DrainBacklog -benchtime 3x ./outbox/
func BenchmarkRelay_DrainBacklog(b *testing.B) {
	const backlog = 10000
	for _, d := range testsvc.Databases() {
		b.Run(d.Name, func(b *testing.B) {
			ctx := context.Background()
			var total time.Duration
			for range b.N {
				b.StopTimer()
				db := d.Open(b)
				ob, err := outbox.New(db, outbox.Config{})
				require.NoError(b, err)
				require.NoError(b, ob.Migrate(ctx))
				for i := 0; i < backlog; i += 50 {
					tx, err := db.BeginTx(ctx, nil)
					require.NoError(b, err)
					msgs := make([]*message.Message, 50)
					for j := range msgs {
						msgs[j] = message.NewMessage(outbox.DerivedID(fmt.Sprint(i+j), "x"), []byte(`{"n":1}`))
					}
					require.NoError(b, ob.PublishTx(ctx, tx, "bench", msgs...))
					require.NoError(b, tx.Commit())
				}
				dest := &counter{}
				r, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: dest, PollInterval: 10 * time.Millisecond, Logger: testLogger})
				require.NoError(b, err)
				b.StartTimer()
				began := time.Now()
				done := make(chan error, 1)
				go func() { done <- r.Run(ctx) }()
				for dest.n.Load() < backlog {
					time.Sleep(time.Millisecond)
				}
				for {
					st, err := r.Stats(ctx)
					require.NoError(b, err)
					if st.Backlog == 0 {
						break
					}
					time.Sleep(time.Millisecond)
				}
				total += time.Since(began)
				b.StopTimer()
				require.NoError(b, r.Close())
				require.NoError(b, <-done)
			}
			b.ReportMetric(float64(backlog*b.N)/total.Seconds(), "msgs/s")
		})
	}
}
