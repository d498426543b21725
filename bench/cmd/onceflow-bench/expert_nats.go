package main

import (
	"context"
	"errors"
	"sync"
	"time"

	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// startExpertNATS starts the expert consumer of NATS JetStream on nats.go's jetstream package:
// a durable pull consumer of the topic's stream, allowed c×128 unacknowledged messages, and c
// workers, each consuming continuously: Consume pulls up to 128 messages ahead of the
// worker's acknowledgements and pulls again once half of them are delivered, so the pull never
// runs dry while the stream has messages. A worker collects up
// to 64 messages or 2 ms, applies them in one transaction and acknowledges each after the
// commit (Ack publishes the acknowledgement without waiting for the server's reply); when the
// transaction fails it naks them, and JetStream delivers them again. A message without an id
// is terminated on its own.
func startExpertNATS(ctx context.Context, t topic, c int, x *expertSQL, m *meter) (func() error, error) {
	nc, js, err := dialJetStream(t.brokerURL)
	if err != nil {
		return nil, err
	}
	var cons jetstream.Consumer
	stream, err := js.StreamNameBySubject(ctx, t.name)
	if err == nil {
		cons, err = js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{
			Durable:       "expert",
			FilterSubject: t.name,
			DeliverPolicy: jetstream.DeliverAllPolicy,
			AckPolicy:     jetstream.AckExplicitPolicy,
			AckWait:       30 * time.Second,
			MaxAckPending: c * expertPrefetch,
		})
	}
	if err != nil {
		nc.Close()
		return nil, err
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	var consumers []jetstream.ConsumeContext
	stop := func() error {
		cancel()
		for _, cc := range consumers {
			cc.Stop()
		}
		wg.Wait()
		nc.Close()
		return nil
	}
	for range c {
		in := make(chan jetstream.Msg, expertPrefetch)
		cc, err := cons.Consume(func(msg jetstream.Msg) {
			select {
			case in <- msg:
			case <-runCtx.Done():
			}
		}, jetstream.PullMaxMessages(expertPrefetch))
		if err != nil {
			_ = stop()
			return nil, err
		}
		consumers = append(consumers, cc)
		wg.Go(func() { natsWorker(runCtx, in, x, m) })
	}
	return stop, nil
}

func natsWorker(ctx context.Context, in <-chan jetstream.Msg, x *expertSQL, m *meter) {
	buf := make([]jetstream.Msg, 0, expertBatch)
	msgs := make([]inMsg, 0, expertBatch)
	ok := make([]jetstream.Msg, 0, expertBatch)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	dbCtx := context.WithoutCancel(ctx)
	for {
		batch, open := collect(ctx, in, buf[:0], expertBatch, expertWait, timer)
		if !open {
			return
		}
		msgs, ok = msgs[:0], ok[:0]
		for _, d := range batch {
			h := d.Headers()
			id := h.Get(wnats.WatermillUUIDHdr)
			if id == "" {
				id = h.Get(nats.MsgIdHdr)
			}
			if id == "" {
				_ = d.Term()
				m.fail(errNoID)
				continue
			}
			msgs = append(msgs, inMsg{id: id, payload: d.Data(), sent: sentAt(h.Get(headerSent))})
			ok = append(ok, d)
		}
		if len(msgs) == 0 {
			continue
		}
		fresh, err := x.apply(dbCtx, msgs)
		if err != nil {
			m.fail(err)
			for _, d := range ok {
				_ = d.Nak()
			}
			continue
		}
		m.committed(fresh, len(msgs))
		for _, d := range ok {
			if err := d.Ack(); err != nil {
				m.fail(errors.Join(errors.New("ack"), err))
			}
		}
	}
}
