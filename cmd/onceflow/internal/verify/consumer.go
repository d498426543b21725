package verify

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// ConsumerConfig is the handler of one mode, which each of its consumer processes builds.
type ConsumerConfig struct {
	// Topic and Name are the handler's topic and name.
	Topic string
	Name  string
	Mode  onceflow.QoS
	// GroupCommit runs the handler with group commit.
	GroupCommit bool
	// Batch processes the messages with a batch processor (it implies group commit).
	Batch bool
	// Dedup is how the handler detects duplicates, when Mode is ExactlyOnce.
	Dedup Dedup
	// MaxDeliveries is the handler's delivery limit.
	MaxDeliveries int
	// Concurrency is the handler's concurrency.
	Concurrency int
	// RunID is the run whose effects the handler counts its own (the effects of a message
	// left on the topic by an earlier run go to that run).
	RunID string
}

// Args returns the flags of the verify-consumer command for c.
func (c ConsumerConfig) Args() []string {
	args := []string{"--topic", c.Topic, "--handler", c.Name, "--mode", c.Mode.String(), "--run", c.RunID,
		"--concurrency", fmt.Sprint(c.Concurrency), "--max-deliveries", fmt.Sprint(c.MaxDeliveries)}
	if c.GroupCommit {
		args = append(args, "--group-commit")
	}
	if c.Batch {
		args = append(args, "--batch")
	}
	if c.Dedup != DedupByID {
		args = append(args, "--dedup", string(c.Dedup))
	}
	return args
}

// effectsTable is the business table of a verification run: one row per applied effect,
// without a unique key, so that a duplicate effect is a second row.
const effectsTable = "onceflow_verify_effects"

// redeliveryDelays are the consumers' redelivery delays: short, so that a message that fails
// every time reaches the delivery limit within the run.
var redeliveryDelays = []time.Duration{50 * time.Millisecond, 100 * time.Millisecond, 200 * time.Millisecond, 500 * time.Millisecond}

// effect is the payload of every message of a run, good or poison: the run whose effects table
// row it writes (none: the INSERT violates NOT NULL).
type effect struct {
	Run *string `json:"run"`
	N   int     `json:"n"`
}

// Handler returns the handler of c, on the subscriber and database of env: it applies one
// effect per message, a row of the effects table, in the chain of c's quality of service.
func (c ConsumerConfig) Handler(env onceflowtest.Env) onceflow.Handler {
	insert := `INSERT INTO ` + effectsTable + ` (run_id, message_id, consumer) VALUES (?, ?, ?)`
	// apply writes the effects of msgs, each in the run its payload names.
	apply := func(ctx context.Context, msgs []*messagedata.MessageData, vs []effect) error {
		tx, ok := processor.TxFromContext(ctx)
		if !ok {
			return errors.New("no transaction")
		}
		q, args := insert, make([]any, 0, 3*len(msgs))
		for i, msg := range msgs {
			if i > 0 {
				q += ", (?, ?, ?)"
			}
			args = append(args, vs[i].Run, msg.ID, env.Consumer)
		}
		_, err := tx.ExecContext(ctx, tx.Rebind(q), args...)
		return err
	}
	h := onceflow.Handler{
		Name:        c.Name,
		Topic:       c.Topic,
		Subscriber:  env.Subscriber,
		DB:          env.DB,
		QoS:         c.Mode,
		Concurrency: max(c.Concurrency, 1),
		// Group commit is the library's default; without --group-commit or --batch, each
		// message has a transaction of its own.
		GroupCommit: onceflow.GroupCommitConfig{Disabled: !c.GroupCommit && !c.Batch},
	}
	if c.Mode != onceflow.BestEffort {
		h.DeadLetter.MaxDeliveries = c.MaxDeliveries
		h.Redelivery = onceflow.RedeliveryConfig{Delays: redeliveryDelays}
		h.Retry = middleware.Retry{MaxAttempts: 5, InitialInterval: 20 * time.Millisecond, MaxInterval: time.Second}
	}
	if c.Mode == onceflow.ExactlyOnceInOrder {
		// A parked message that fails when its gap fills waits for the sweeper: soon, so that
		// the run does not wait the default 10 s for each.
		h.Order.SweepInterval = 500 * time.Millisecond
	}
	switch c.Dedup {
	case DedupByOffset:
		h.Dedup.Mode = middleware.DedupByOffset
	case DedupAckInTx:
		h.Dedup.Mode = middleware.DedupAckInTransaction
	}
	if c.Batch {
		h.BatchProcessor = processor.JSONBatch(apply)
	} else {
		h.Processor = processor.JSON(func(ctx context.Context, msg *messagedata.MessageData, v effect) error {
			return apply(ctx, []*messagedata.MessageData{msg}, []effect{v})
		})
	}
	return h
}

// Consume runs this process as a consumer of the mode that c describes, for the run that
// started it, until ctx ends or the run stops it.
func Consume(ctx context.Context, c ConsumerConfig) error {
	return onceflowtest.Consume(ctx, c.Handler)
}

// migrate creates the effects table.
func migrate(ctx context.Context, db *sqldb.DB) error {
	ddl := `CREATE TABLE IF NOT EXISTS ` + effectsTable + ` (
		run_id VARCHAR(32) NOT NULL,
		message_id VARCHAR(64) NOT NULL,
		consumer INTEGER NOT NULL)`
	if _, err := db.ExecContext(ctx, ddl); err != nil {
		return fmt.Errorf("create %s: %w", effectsTable, err)
	}
	// PostgreSQL, MariaDB and SQLite all accept CREATE INDEX IF NOT EXISTS.
	idx := `CREATE INDEX IF NOT EXISTS onceflow_verify_effects_run ON ` + effectsTable + ` (run_id, message_id)`
	if _, err := db.ExecContext(ctx, idx); err != nil {
		return fmt.Errorf("index %s: %w", effectsTable, err)
	}
	return nil
}
