package conformance

import (
	"context"
	"errors"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// TestDeadLetterIsNotPublishedAgainWhenItsAckIsLost: a message that fails permanently is
// published to the dead-letter topic and then acknowledged; when the acknowledgement is lost
// (its consumer dies, or its connection drops, between the two) the broker delivers the message
// again. The router recorded the dead letter in the delivery counter table after publishing
// it, so the redelivery is acknowledged without a second one. (A consumer that dies between the
// publish and the record still publishes it again.)
func TestDeadLetterIsNotPublishedAgainWhenItsAckIsLost(t *testing.T) {
	brokerURL := "mem://" + testsvc.UniqueName("deadletter")
	f := newFixture(t, Setup{
		BrokerURL:   func(testing.TB) string { return brokerURL },
		DatabaseURL: func(t testing.TB) string { return testsvc.SQLiteURL(t) },
	}, DefaultFeatures(brokerURL), PerMessage)
	b := f.openBroker(f.brokerURL)
	dead := f.collectDeadLetters(b)
	topic := f.topic("in")

	r, err := onceflow.NewRouter(onceflow.Config{
		DeadLetterPublisher: b.Publisher(), DeadLetterTopic: f.dlq, Logger: f.logger, PurgeInterval: -1, CloseTimeout: 5 * time.Second,
	})
	require.NoError(t, err)
	var lost sync.Once
	// Outside the dead-letter stage: the dead letter is out, and the acknowledgement is lost once.
	loseFirstAck := onceflow.Use("lose-first-ack", func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			err := next.Process(ctx, msg)
			lose := false
			if processor.IsDeadLettered(err) {
				lost.Do(func() { lose = true })
			}
			if lose {
				return errAckLost
			}
			return err
		})
	})
	sub, err := b.Subscriber()
	require.NoError(t, err)
	p := newProbe(t)
	h := f.handler(handlerSpec{Name: "effects", Topic: topic, Processor: processor.Func(func(context.Context, *messagedata.MessageData) error {
		return processor.Permanent(errors.New("rejected by a business rule"))
	})}, p.wrap("effects", sub))
	h.Chain = onceflow.ExactlyOnce.Chain().Before(onceflow.StageDeadLetter, loseFirstAck)
	require.NoError(t, r.AddHandler(h))
	testsvc.StartRouter(t, r)

	id := f.id("rejected")
	f.publish(b, topic, id, "x")
	f.waitAcks(p, "effects", id, 1)
	time.Sleep(200 * time.Millisecond)
	require.Equal(t, deliveryCounts{Deliveries: 2, Acks: 1, Nacks: 1}, p.get("effects", id), "the delivery whose ack was lost, then its redelivery")
	require.Len(t, dead.all(), 1, "dead-lettered once, although delivered twice")
}

// deadLetterStep is a point of the dead-letter path at which the test's consumer dies.
type deadLetterStep string

const (
	beforePublish deadLetterStep = "before-publish" // nothing is out yet
	afterPublish  deadLetterStep = "after-publish"  // the dead letter is out, not recorded
	afterRecord   deadLetterStep = "after-record"   // recorded, not acknowledged
)

// dieOnce ends the calling goroutine, the delivery's, the first time it is called for each
// message id: nothing that would follow in the delivery runs (no record, no acknowledgement,
// no nack), as when the consumer process dies there, and the broker delivers the message
// again once its lease has passed (Timings.AckTimeout).
type dieOnce struct {
	mu   sync.Mutex
	died map[string]bool
}

func (d *dieOnce) at(id string) {
	d.mu.Lock()
	first := !d.died[id]
	d.died[id] = true
	d.mu.Unlock()
	if first {
		runtime.Goexit()
	}
}

// dyingPublisher is the dead-letter publisher of a consumer that dies just before or just
// after the dead letter's publish.
type dyingPublisher struct {
	message.Publisher
	step deadLetterStep
	die  *dieOnce
}

func (p dyingPublisher) Publish(topic string, msgs ...*message.Message) error {
	id := msgs[0].UUID
	if p.step == beforePublish {
		p.die.at(id)
	}
	err := p.Publisher.Publish(topic, msgs...)
	if p.step == afterPublish && err == nil {
		p.die.at(id)
	}
	return err
}

// TestDeadLetterIsPublishedOnceWhateverStepItsConsumerDiesAt: a consumer dies at each step of
// the dead-letter path, once per message: before the dead letter's publish, between the
// publish and the router's record of it, and between the record and the acknowledgement. The
// broker delivers the message again, and the next delivery finishes the job: the dead letter
// is on the dead-letter topic exactly once, the message acked exactly once, in every quality
// of service that dead-letters. Between the publish and the record the next delivery
// publishes the dead letter again, under the same key (messagedata.HeaderDeadLetterKey): the
// SQLite and SQL queues and NATS store it once; a broker that cannot tell (Redis here,
// RabbitMQ and Kafka too) stores the second copy, and nowhere else does one appear.
func TestDeadLetterIsPublishedOnceWhateverStepItsConsumerDiesAt(t *testing.T) {
	brokers := []struct {
		name string
		url  func(t testing.TB) string
	}{
		{"sqlite", func(t testing.TB) string { return "sqlite://" + filepath.Join(t.TempDir(), "queue.db") }},
		{"postgres", testsvc.PostgresSchemaURL},
		{"nats", testsvc.NATSURL},
		{"redis", testsvc.RedisURL},
	}
	for _, bk := range brokers {
		for _, qos := range []onceflow.QoS{onceflow.AtLeastOnce, onceflow.ExactlyOnce} {
			for _, step := range []deadLetterStep{beforePublish, afterPublish, afterRecord} {
				t.Run(bk.name+"/"+qos.String()+"/"+string(step), func(t *testing.T) {
					t.Parallel()
					testDeadLetterStep(t, bk.url(t), qos, step)
				})
			}
		}
	}
}

func testDeadLetterStep(t *testing.T, brokerURL string, qos onceflow.QoS, step deadLetterStep) {
	f := newFixture(t, Setup{
		BrokerURL:   func(testing.TB) string { return brokerURL },
		DatabaseURL: func(t testing.TB) string { return testsvc.SQLiteURL(t) },
	}, DefaultFeatures(brokerURL), PerMessage)
	b := f.openBroker(f.brokerURL)
	topic := f.topic("in")
	die := &dieOnce{died: map[string]bool{}}

	var pub message.Publisher = b.Publisher()
	if step != afterRecord {
		pub = dyingPublisher{Publisher: pub, step: step, die: die}
	}
	r, err := onceflow.NewRouter(onceflow.Config{
		DeadLetterPublisher: pub, DeadLetterTopic: f.dlq, Logger: f.logger, PurgeInterval: -1, CloseTimeout: 5 * time.Second,
	})
	require.NoError(t, err)
	// Outside the dead-letter stage: the dead letter is out and recorded; the acknowledgement
	// is not.
	dieAfterRecord := onceflow.Use("die-after-record", func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			err := next.Process(ctx, msg)
			if step == afterRecord && processor.IsDeadLettered(err) {
				die.at(msg.ID)
			}
			return err
		})
	})
	permanent, panics := f.id("permanent"), f.id("panics")
	sub, err := b.Subscriber()
	require.NoError(t, err)
	p := newProbe(t)
	h := f.handler(handlerSpec{Name: "effects", Topic: topic, MaxDeliveries: 2, Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
		switch msg.ID {
		case permanent:
			return processor.Permanent(errors.New("rejected by a business rule"))
		case panics:
			panic("poison")
		}
		return writeEffect(ctx, "effects", msg)
	})}, p.wrap("effects", sub))
	h.Chain = qos.Chain().Before(onceflow.StageDeadLetter, dieAfterRecord)
	require.NoError(t, r.AddHandler(h))
	testsvc.StartRouter(t, r)

	good := f.id("good")
	for _, id := range []string{permanent, panics, good} {
		f.publish(b, topic, id, "x")
	}
	f.waitAcks(p, "effects", good, 1)
	f.waitAcks(p, "effects", permanent, 1)
	f.waitAcks(p, "effects", panics, 1)

	// Each message was acknowledged once, after its dead letter was published: the dead-letter
	// topic holds what it will hold.
	want := 1
	if step == afterPublish && !f.features.DeduplicatesDeadLetters {
		want = 2 // the second copy, under the same key
	}
	dead := map[string][]*message.Message{}
	for _, m := range peekAll(t, b, f.dlq) {
		dead[m.UUID] = append(dead[m.UUID], m)
	}
	require.Len(t, dead[permanent], want, "dead letters of the message that fails permanently")
	require.Len(t, dead[panics], want, "dead letters of the message that panics")
	require.Len(t, dead, 2, "no other message is dead-lettered")
	for id, ms := range dead {
		for _, m := range ms {
			require.Equal(t, middleware.DeadLetterKey("effects", id, ""), m.Metadata.Get(messagedata.HeaderDeadLetterKey))
		}
	}
	require.Positive(t, f.effects("effects", good))

	// The first delivery of the permanent failure died; the next one finished the job. The
	// panic was nacked at its first delivery, died at the dead letter of its second (the
	// delivery limit), and the third finished it. (On a machine so busy that a delivery
	// outlives its lease, the broker delivers it once more: the record acknowledges that one
	// without a dead letter, which the counts above check.)
	perm, pan := p.get("effects", permanent), p.get("effects", panics)
	require.GreaterOrEqual(t, perm.Deliveries, 2, "the delivery that died came again: %+v", perm)
	require.Zero(t, perm.Nacks, "%+v", perm)
	require.GreaterOrEqual(t, pan.Deliveries, 3, "nacked, died at the limit, came again: %+v", pan)
	require.Equal(t, 1, pan.Nacks, "%+v", pan)
}

// peekAll returns every message waiting on topic for b's consumer group.
func peekAll(t *testing.T, b *broker.Broker, topic string) []*message.Message {
	t.Helper()
	msgs, err := b.Peek(context.Background(), topic, 100)
	require.NoError(t, err)
	return msgs
}

// TestDeadLetter_AtLeastOnceMessageWhoseRedeliveriesCommittedIsNotDeadLetteredOverTheLimit: a
// handler without duplicate detection (AtLeastOnce) whose message is processed and committed,
// then loses its acknowledgement, delivery after delivery, until it is over its delivery limit.
// Its effect is there (twice: at least once), so it is acknowledged, not dead-lettered: the
// router recorded in the delivery counter that a redelivery of it was processed.
func TestDeadLetter_AtLeastOnceMessageWhoseRedeliveriesCommittedIsNotDeadLetteredOverTheLimit(t *testing.T) {
	brokerURL := "sqlite://" + filepath.Join(t.TempDir(), "queue.db")
	f := newFixture(t, Setup{
		BrokerURL:   func(testing.TB) string { return brokerURL },
		DatabaseURL: func(t testing.TB) string { return testsvc.SQLiteURL(t) },
	}, DefaultFeatures(brokerURL), PerMessage)
	b := f.openBroker(f.brokerURL)
	topic := f.topic("in")
	r, err := onceflow.NewRouter(onceflow.Config{
		DeadLetterPublisher: b.Publisher(), DeadLetterTopic: f.dlq, Logger: f.logger, PurgeInterval: -1, CloseTimeout: 5 * time.Second,
	})
	require.NoError(t, err)
	// Outside the dead-letter stage: every delivery up to the limit commits and loses its ack.
	loseAcks := onceflow.Use("lose-acks", func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			err := next.Process(ctx, msg)
			if err == nil && msg.Delivery <= 2 {
				return errAckLost
			}
			return err
		})
	})
	sub, err := b.Subscriber()
	require.NoError(t, err)
	p := newProbe(t)
	h := f.handler(handlerSpec{Name: "effects", Topic: topic, MaxDeliveries: 2}, p.wrap("effects", sub))
	h.Chain = onceflow.AtLeastOnce.Chain().Before(onceflow.StageDeadLetter, loseAcks)
	require.NoError(t, r.AddHandler(h))
	testsvc.StartRouter(t, r)

	id := f.id("committed")
	f.publish(b, topic, id, "x")
	f.waitAcks(p, "effects", id, 1)
	require.Equal(t, deliveryCounts{Deliveries: 3, Acks: 1, Nacks: 2}, p.get("effects", id), "two deliveries whose ack was lost, then one over the limit")
	require.Equal(t, 2, f.effects("effects", id), "at least once")
	require.Empty(t, peekAll(t, b, f.dlq), "not dead-lettered")
}
