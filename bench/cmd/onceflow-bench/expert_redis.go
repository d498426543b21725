package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/redis/go-redis/v9"
)

// startExpertRedis starts the expert consumer of Redis Streams on go-redis: c workers, each a
// consumer of the topic's consumer group, reading up to 64 entries with one XREADGROUP,
// applying them in one transaction and acknowledging them with one XACK after the commit. A
// worker first reads the entries it holds unacknowledged (after a failed transaction, or a
// restart under the same name), then new ones. An entry without an id is acknowledged without
// effect. (Taking over the entries of a consumer that died, with XAUTOCLAIM, is left out: no
// worker dies here.)
func startExpertRedis(ctx context.Context, t topic, c int, x *expertSQL, m *meter) (func() error, error) {
	// Each worker blocks a connection in XREADGROUP and needs another for XACK.
	client, err := dialRedis(t.brokerURL, 2*c)
	if err != nil {
		return nil, err
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	for i := range c {
		wg.Go(func() { redisWorker(runCtx, client, t.name, fmt.Sprintf("expert-%d", i), x, m) })
	}
	return func() error {
		cancel()
		wg.Wait()
		return client.Close()
	}, nil
}

func redisWorker(ctx context.Context, client *redis.Client, stream, consumer string, x *expertSQL, m *meter) {
	msgs := make([]inMsg, 0, expertBatch)
	ids := make([]string, 0, expertBatch)
	dbCtx := context.WithoutCancel(ctx)
	own := true // read the entries this consumer holds before new ones
	for ctx.Err() == nil {
		from := ">"
		if own {
			from = "0"
		}
		res, err := client.XReadGroup(ctx, &redis.XReadGroupArgs{
			Group: consumerGroup, Consumer: consumer, Streams: []string{stream, from},
			Count: expertBatch, Block: 100 * time.Millisecond,
		}).Result()
		if errors.Is(err, redis.Nil) {
			continue
		}
		if err != nil {
			if ctx.Err() == nil {
				m.fail(err)
				time.Sleep(10 * time.Millisecond)
			}
			continue
		}
		var entries []redis.XMessage
		if len(res) > 0 {
			entries = res[0].Messages
		}
		if own && len(entries) == 0 {
			own = false
			continue
		}
		msgs, ids = msgs[:0], ids[:0]
		for _, e := range entries {
			ids = append(ids, e.ID)
			id, _ := e.Values[redisstream.UUIDHeaderKey].(string)
			if id == "" {
				m.fail(errNoID)
				continue
			}
			payload, _ := e.Values["payload"].(string)
			msgs = append(msgs, inMsg{id: id, payload: []byte(payload), sent: sentAt(e.Values[headerSent])})
		}
		fresh, err := x.apply(dbCtx, msgs)
		if err != nil {
			m.fail(err)
			own = true // read them again
			continue
		}
		m.committed(fresh, len(msgs))
		if err := client.XAck(dbCtx, stream, consumerGroup, ids...).Err(); err != nil {
			m.fail(err)
			own = true
		}
	}
}
