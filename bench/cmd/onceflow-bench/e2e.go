package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"golang.org/x/sync/errgroup"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	rabbitmq "github.com/onceflow/onceflow/broker/amqp"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// consumerGroup is the consumer group of every benchmark consumer: the AMQP queue of topic T
// is "T.bench".
const consumerGroup = "bench"

// cellTables are the tables of one cell, created fresh for it.
type cellTables struct {
	effects   string // the business table: one row per applied message, no unique key
	dedup     string // onceflow's dedup table
	processed string // the baseline's processed-messages table
}

func newCellTables(id string) cellTables {
	return cellTables{effects: "bench_effects_" + id, dedup: "bench_dedup_" + id, processed: "bench_processed_" + id}
}

func (t cellTables) create(ctx context.Context, db *sqldb.DB) error {
	blob := map[sqldb.Dialect]string{sqldb.Postgres: "BYTEA", sqldb.MySQL: "BLOB", sqldb.SQLite: "BLOB"}[db.Dialect]
	for _, stmt := range []string{
		`CREATE TABLE ` + t.effects + ` (message_id VARCHAR(255) NOT NULL, payload ` + blob + ` NOT NULL)`,
		`CREATE TABLE ` + t.processed + ` (id VARCHAR(255) NOT NULL PRIMARY KEY)`,
	} {
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("%s: %w", stmt, err)
		}
	}
	return nil
}

func (t cellTables) drop(ctx context.Context, db *sqldb.DB) {
	for _, name := range []string{t.effects, t.dedup, t.processed} {
		_, _ = db.ExecContext(ctx, `DROP TABLE IF EXISTS `+name)
	}
}

// effectInsert is the business statement: one row with the message id and payload.
func effectInsert(db *sqldb.DB, table string) string {
	return db.Rebind(`INSERT INTO ` + table + ` (message_id, payload) VALUES (?, ?)`)
}

// openDB opens the cell's database: a new pool, as a consumer process starting would.
func (s *suite) openDB(ctx context.Context, st setup, dir string) (*sqldb.DB, error) {
	var rawURL string
	switch st.Database {
	case "postgres":
		rawURL = s.pgURL
	case "mysql":
		rawURL = s.myURL
	default:
		rawURL = "sqlite://" + filepath.Join(dir, "app.db")
	}
	db, err := sqldb.Open(ctx, rawURL)
	if err != nil {
		return nil, err
	}
	if s.cfg.maxIdle > 0 {
		db.SetMaxIdleConns(s.cfg.maxIdle)
	}
	return db, nil
}

// meter counts processed messages and marks the moments the warm-up ends and the last message
// is processed.
type meter struct {
	n              atomic.Int64
	warm, target   int64
	warmAt, doneAt chan time.Time
}

func newMeter(warm, target int) *meter {
	return &meter{warm: int64(warm), target: int64(target), warmAt: make(chan time.Time, 1), doneAt: make(chan time.Time, 1)}
}

func (m *meter) tick() {
	switch m.n.Add(1) {
	case m.warm:
		m.warmAt <- time.Now()
	case m.target:
		m.doneAt <- time.Now()
	}
}

// runE2E measures one onceflow mode or the watermill baseline: it publishes the cell's messages
// (not measured), starts the consumer, and times the messages after the warm-up, up to the
// commit of the last one.
func (s *suite) runE2E(ctx context.Context, st setup, v string, c int, e *Entry) error {
	id := newID()
	dir := filepath.Join(s.svc.dir, id)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	db, err := s.openDB(ctx, st, dir)
	if err != nil {
		return err
	}
	defer db.Close()
	tables := newCellTables(id)
	if err := tables.create(ctx, db); err != nil {
		return err
	}
	defer tables.drop(context.WithoutCancel(ctx), db)

	n := s.messagesFor(st, v, c)
	warm := max(int(float64(n)*s.cfg.warmup), 1)
	e.Messages = n - warm
	topic := "bench_" + id
	brokerURL := s.svc.amqp
	if st.Broker == "sqlite" {
		brokerURL = "sqlite://" + filepath.Join(dir, "queue.db")
	}
	if err := s.publish(ctx, st, brokerURL, topic, n); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	if st.Broker == "amqp" {
		defer deleteAMQPTopic(s.svc.amqp, topic)
	}

	m := newMeter(warm, n)
	insert := effectInsert(db, tables.effects)
	var stop func() error
	if v == vBaseline {
		stop, err = s.startBaseline(ctx, st, brokerURL, db, topic, tables, c, m)
	} else {
		stop, err = s.startOnceflow(ctx, brokerURL, db, topic, tables, v, c, processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			tx, _ := processor.CurrentTx(ctx)
			if _, err := tx.ExecContext(ctx, insert, msg.ID, msg.Payload); err != nil {
				return err
			}
			m.tick()
			return nil
		}))
	}
	if err != nil {
		return fmt.Errorf("start consumer: %w", err)
	}
	stopped := false
	defer func() {
		if !stopped {
			_ = stop()
		}
	}()

	timeout := time.Duration(float64(time.Second) * max(120, 10*float64(n)/guessRate(st, v, c)))
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	var t0 time.Time
	select {
	case t0 = <-m.warmAt:
	case <-deadline.C:
		return fmt.Errorf("%d of %d messages processed after %s", m.n.Load(), n, timeout)
	case <-ctx.Done():
		return ctx.Err()
	}
	cpu0, wal0 := sampleCPU(), pgWAL(ctx, db)
	var prof *os.File
	if s.cfg.profileDir != "" && c == slices.Max(s.cfg.concurrency) {
		if prof, err = startProfile(s.cfg.profileDir, e.Name); err != nil {
			return err
		}
	}
	select {
	case <-m.doneAt:
	case <-deadline.C:
		return fmt.Errorf("%d of %d messages processed after %s", m.n.Load(), n, timeout)
	case <-ctx.Done():
		return ctx.Err()
	}
	// The processor ran for the last message; wait for its commit.
	count := func() (int, error) {
		var got int
		err := db.QueryRowxContext(ctx, `SELECT COUNT(*) FROM `+tables.effects).Scan(&got)
		return got, err
	}
	for {
		got, err := count()
		if err != nil {
			return err
		}
		if got >= n {
			break
		}
		select {
		case <-deadline.C:
			return fmt.Errorf("%d of %d effects committed after %s", got, n, timeout)
		case <-time.After(2 * time.Millisecond):
		}
	}
	t1 := time.Now()
	cpu1, wal1 := sampleCPU(), pgWAL(ctx, db)
	if prof != nil {
		pprof.StopCPUProfile()
		_ = prof.Close()
	}
	stopped = true
	if err := stop(); err != nil {
		return fmt.Errorf("stop consumer: %w", err)
	}

	elapsed := t1.Sub(t0).Seconds()
	e.Seconds = round2(elapsed)
	e.MsgsPerS = float64(int(float64(e.Messages) / elapsed))
	e.CPU = cpuUse(cpu0, cpu1)
	e.CPUPerMsg = cpuPerMsg(e.CPU, elapsed, e.Messages)
	e.ConnsClosedIdle = db.Stats().MaxIdleClosed
	e.setWAL(wal0, wal1, e.Messages)
	got, err := count()
	if err != nil {
		return err
	}
	// No unique key on the business table: a duplicate effect would be a row too many.
	if got != n {
		return fmt.Errorf("%d effects for %d messages", got, n)
	}
	return nil
}

func startProfile(dir, name string) (*os.File, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	f, err := os.Create(filepath.Join(dir, "cpu-"+sanitize(name)+".pprof"))
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, err
	}
	return f, nil
}

func sanitize(s string) string {
	b := []byte(s)
	for i, c := range b {
		if c == '/' {
			b[i] = '_'
		}
	}
	return string(b)
}

// startOnceflow starts an onceflow Router with one handler of the variant's mode.
func (s *suite) startOnceflow(ctx context.Context, brokerURL string, db *sqldb.DB, topic string, tables cellTables, v string, c int, p processor.Processor) (func() error, error) {
	b, err := broker.Open(ctx, brokerURL, broker.Options{ConsumerGroup: consumerGroup, Prefetch: s.cfg.prefetch})
	if err != nil {
		return nil, err
	}
	stop, err := startRouter(ctx, b, db, topic, tables.dedup, v, c, s.logger, p)
	if err != nil {
		_ = b.Close()
		return nil, err
	}
	return func() error { return errors.Join(stop(), b.Close()) }, nil
}

// qosOf returns the quality of service of an onceflow variant, and whether it uses group
// commit.
func qosOf(v string) (onceflow.QoS, bool) {
	switch v {
	case vAtLeastOnce:
		return onceflow.AtLeastOnce, false
	case vGroupCommit:
		return onceflow.ExactlyOnce, true
	}
	return onceflow.ExactlyOnce, false
}

// startRouter runs a Router with the handler "bench" on b until the returned stop is called.
func startRouter(ctx context.Context, b *broker.Broker, db *sqldb.DB, topic, dedupTable, v string, c int, logger *slog.Logger, p processor.Processor) (func() error, error) {
	sub, err := b.Subscriber()
	if err != nil {
		return nil, err
	}
	r, err := onceflow.NewRouter(onceflow.Config{
		DeadLetterPublisher: b.Publisher(),
		DeadLetterTopic:     topic + "_dead",
		Logger:              logger,
		PurgeInterval:       -1,
		CloseTimeout:        10 * time.Second,
	})
	if err != nil {
		return nil, err
	}
	qos, group := qosOf(v)
	if err := r.AddHandler(onceflow.Handler{
		Name:        "bench",
		Topic:       topic,
		Subscriber:  sub,
		Processor:   p,
		QoS:         qos,
		DB:          db,
		Concurrency: c,
		GroupCommit: onceflow.GroupCommitConfig{Enabled: group},
		Dedup:       onceflow.DedupConfig{Table: dedupTable},
	}); err != nil {
		return nil, err
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	select {
	case <-r.Running():
	case err := <-done:
		cancel()
		return nil, fmt.Errorf("router stopped before running: %w", err)
	}
	return func() error {
		cancel()
		return <-done
	}, nil
}

// publish puts n messages on topic; it is not measured. AMQP messages go out on several
// channels with pipelined publisher confirms, since waiting for each confirm in turn is slow.
func (s *suite) publish(ctx context.Context, st setup, brokerURL, topic string, n int) error {
	if st.Broker == "amqp" {
		return publishAMQP(ctx, brokerURL, topic, n, s.payload)
	}
	q, err := sqlitequeue.Open(ctx, brokerURL, sqlitequeue.Config{ConsumerGroup: consumerGroup})
	if err != nil {
		return err
	}
	defer q.Close()
	pub := q.Publisher()
	batch := make([]*message.Message, 0, 500)
	for i := range n {
		batch = append(batch, message.NewMessage(watermill.NewUUID(), s.payload))
		if len(batch) == cap(batch) || i == n-1 {
			if err := pub.Publish(topic, batch...); err != nil {
				return err
			}
			batch = batch[:0]
		}
	}
	return nil
}

// publishAMQP declares the topology onceflow uses (a fanout exchange named after the topic and
// the durable queue "<topic>.bench" bound to it) and publishes n persistent messages, marshaled
// as onceflow's broker does, waiting for every publisher confirm.
func publishAMQP(ctx context.Context, amqpURL, topic string, n int, payload []byte) error {
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	queue := topic + "." + consumerGroup
	if err := ch.ExchangeDeclare(topic, "fanout", true, false, false, false, nil); err != nil {
		return err
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		return err
	}
	if err := ch.QueueBind(queue, "", topic, false, nil); err != nil {
		return err
	}
	_ = ch.Close()

	const workers, window = 4, 256
	var next atomic.Int64
	g, gctx := errgroup.WithContext(ctx)
	for range workers {
		g.Go(func() error {
			ch, err := conn.Channel()
			if err != nil {
				return err
			}
			defer ch.Close()
			if err := ch.Confirm(false); err != nil {
				return err
			}
			var pending []*amqp.DeferredConfirmation
			wait := func() error {
				for _, dc := range pending {
					ok, err := dc.WaitContext(gctx)
					if err != nil {
						return err
					}
					if !ok {
						return errors.New("publish nacked by the broker")
					}
				}
				pending = pending[:0]
				return nil
			}
			for next.Add(1) <= int64(n) {
				p, err := rabbitmq.Marshaler{}.Marshal(message.NewMessage(watermill.NewUUID(), payload))
				if err != nil {
					return err
				}
				dc, err := ch.PublishWithDeferredConfirmWithContext(gctx, topic, "", false, false, p)
				if err != nil {
					return err
				}
				if pending = append(pending, dc); len(pending) == window {
					if err := wait(); err != nil {
						return err
					}
				}
			}
			return wait()
		})
	}
	return g.Wait()
}

// deleteAMQPTopic deletes the exchange and queues a cell declared.
func deleteAMQPTopic(amqpURL, topic string) {
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return
	}
	defer conn.Close()
	for _, name := range []string{topic, topic + "_dead"} {
		// A failed delete closes the channel: one channel per statement.
		for _, del := range []func(*amqp.Channel) error{
			func(ch *amqp.Channel) error {
				_, err := ch.QueueDelete(name+"."+consumerGroup, false, false, false)
				return err
			},
			func(ch *amqp.Channel) error { return ch.ExchangeDelete(name, false, false) },
		} {
			if ch, err := conn.Channel(); err == nil {
				_ = del(ch)
				_ = ch.Close()
			}
		}
	}
}
