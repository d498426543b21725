package onceflowtest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	_ "github.com/onceflow/onceflow/broker/amqp"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
)

// The handlers under test book payments into a ledger table without a unique key of its own,
// so that an effect applied twice is a second row.

type payment struct {
	Cents int64 `json:"cents"`
}

func createLedger(ctx context.Context, db *sqldb.DB) error {
	_, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS ledger (payment_id VARCHAR(64) NOT NULL, cents BIGINT NOT NULL)`)
	return err
}

const countLedger = `SELECT payment_id, COUNT(*) FROM ledger GROUP BY payment_id`

func paymentMessage(i int) onceflowtest.Message {
	return onceflowtest.Message{Payload: []byte(fmt.Sprintf(`{"cents":%d}`, 100+i))}
}

// book writes the payment through the handler's transaction: the right way.
var book = processor.JSON(func(ctx context.Context, msg *messagedata.MessageData, p payment) error {
	tx, _ := processor.TxFromContext(ctx)
	_, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO ledger (payment_id, cents) VALUES (?, ?)`), msg.ID, p.Cents)
	return err
})

// ledger returns a Config for the handler that handler builds from env, on the ledger table.
func ledger(handler func(env onceflowtest.Env) onceflow.Handler) onceflowtest.Config {
	return onceflowtest.Config{
		Handler: handler,
		Setup:   createLedger,
		Message: paymentMessage,
		Effects: countLedger,
	}
}

// broken sizes a run for a handler that is expected to fail: small, with three random kills,
// so that each crash point after them is armed once, three injected failures, and neither
// connection cuts nor poison messages, which add nothing to what these handlers get wrong.
func broken(cfg onceflowtest.Config) onceflowtest.Config {
	cfg.Messages, cfg.Kills, cfg.Failures, cfg.Cuts, cfg.Poison = 60, 3, 3, onceflowtest.None, onceflowtest.NoPoison
	return cfg
}

func TestProve_AnExactlyOnceHandlerHoldsOnTheEmbeddedDefault(t *testing.T) {
	t.Parallel()
	r := onceflowtest.Prove(t, ledger(func(env onceflowtest.Env) onceflow.Handler {
		return onceflow.Handler{Name: "ledger", Topic: "payments", Subscriber: env.Subscriber, DB: env.DB,
			QoS: onceflow.ExactlyOnce, Concurrency: 2, Processor: book}
	}))
	require.True(t, r.ExactlyOnce(), r.String())
	require.Zero(t, r.Lost)
	require.Zero(t, r.Duplicated)
	require.Equal(t, 200, r.Messages)
	require.Equal(t, 20, r.Duplicates)
	require.Equal(t, 4, r.Failures)
	require.Equal(t, 2, r.Panics)
	require.GreaterOrEqual(t, r.Kills, 4, "the random kills, and the crash points after them")
	require.Positive(t, r.CrashPoints[onceflowtest.AfterCommit], "the first restart is armed after the commit")
	require.NotNil(t, r.Poison)
	require.Equal(t, 3, r.Poison.Published, "panic, error and long-id")
	require.Equal(t, 3, r.Poison.DeadLettered)
	require.Zero(t, r.Poison.GoodDeadLettered)
	require.Contains(t, r.Poison.Reasons["panic"], "delivery limit reached")
	require.Contains(t, r.Poison.Reasons["long-id"], "dedup key too long")
	require.Empty(t, r.Accounts)
	require.NoError(t, r.Err())
}

// An AtLeastOnce handler is exactly-once when its effect is idempotent: here a unique key
// refuses the second INSERT of a payment, which processor.RowsAffectedOrDuplicate takes for a
// duplicate.
func TestProve_AnAtLeastOnceHandlerWithAnIdempotentEffectHolds(t *testing.T) {
	t.Parallel()
	r := onceflowtest.Prove(t, onceflowtest.Config{
		Messages: 100,
		Setup: func(ctx context.Context, db *sqldb.DB) error {
			_, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS booked (payment_id VARCHAR(64) PRIMARY KEY, cents BIGINT NOT NULL)`)
			return err
		},
		Handler: func(env onceflowtest.Env) onceflow.Handler {
			return onceflow.Handler{Name: "booked", Topic: "payments", Subscriber: env.Subscriber, DB: env.DB, QoS: onceflow.AtLeastOnce,
				Processor: processor.JSON(func(ctx context.Context, msg *messagedata.MessageData, p payment) error {
					tx, _ := processor.TxFromContext(ctx)
					return processor.RowsAffectedOrDuplicate(tx.ExecContext(ctx,
						tx.Rebind(`INSERT INTO booked (payment_id, cents) VALUES (?, ?) ON CONFLICT (payment_id) DO NOTHING`), msg.ID, p.Cents))
				})}
		},
		Message: paymentMessage,
		Effects: `SELECT payment_id, COUNT(*) FROM booked GROUP BY payment_id`,
	})
	require.NoError(t, r.Err())
	require.Equal(t, 10, r.Duplicates)
	require.Equal(t, 2, r.Poison.Published, "panic and error; no long id without a record per id")
	require.Contains(t, r.Poison.Left["long-id"], "not poison")
}

// recorder is a test that keeps the errors Prove reports instead of failing: the tests below
// expect them.
type recorder struct {
	testing.TB
	mu   sync.Mutex
	errs []string
}

func (r *recorder) Error(args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errs = append(r.errs, fmt.Sprint(args...))
}

func (r *recorder) Errorf(format string, args ...any) { r.Error(fmt.Sprintf(format, args...)) }

// proveBroken runs cfg, which must fail, and returns the one error Prove reported, which the
// test log shows.
func proveBroken(t *testing.T, cfg onceflowtest.Config) (onceflowtest.Report, string) {
	t.Helper()
	rec := &recorder{TB: t}
	r := onceflowtest.Prove(rec, broken(cfg))
	require.Len(t, rec.errs, 1, "Prove fails the test once, with the account")
	require.False(t, r.ExactlyOnce())
	require.Equal(t, rec.errs[0], r.Err().Error())
	t.Logf("the error Prove reports:\n%s", rec.errs[0])
	return r, rec.errs[0]
}

// perMessage gives the two handlers below that write outside the handler's transaction a
// transaction per message, so that each fault the run injects is one message's account. Under
// group commit they fail too, and Prove says so, but differently from run to run: a failure
// rolls back a whole group, and a write outside the group's transaction can wait on rows a
// group holds while that group waits for it, which PostgreSQL cannot see as a deadlock, until
// the delivery's deadline ends the wait (seen as messages reported lost, every delivery ending
// "group commit: context canceled").
var perMessage = onceflow.GroupCommitConfig{Disabled: true}

// A processor that writes through its own connection (the handler's DB, not its transaction)
// keeps its write when the transaction rolls back: the failure the run injects after it
// returned makes the retry write the payment again.
func TestProve_CatchesAProcessorThatWritesOutsideTheTransaction(t *testing.T) {
	t.Parallel()
	var dbURL string
	if !onceflowtest.IsConsumer() {
		dbURL = testsvc.PostgresSchemaURL(t) // not again in each consumer: the run gives them its URL
	}
	cfg := ledger(func(env onceflowtest.Env) onceflow.Handler {
		return onceflow.Handler{Name: "ledger", Topic: "payments", Subscriber: env.Subscriber, DB: env.DB, QoS: onceflow.ExactlyOnce,
			GroupCommit: perMessage,
			Processor: processor.JSON(func(ctx context.Context, msg *messagedata.MessageData, p payment) error {
				_, err := env.DB.ExecContext(ctx, env.DB.Rebind(`INSERT INTO ledger (payment_id, cents) VALUES (?, ?)`), msg.ID, p.Cents)
				return err
			})}
	})
	cfg.DBURL = dbURL
	r, msg := proveBroken(t, cfg)
	require.GreaterOrEqual(t, r.Duplicated, r.Failures, "every message failed once after its write is applied twice")
	require.Contains(t, msg, "applied 2 times")
	a := accountWith(t, r, "yet an effect stayed, and the retry applied it again: the processor (or a stage inside the transaction) writes outside the handler's transaction; write through processor.TxFromContext")
	require.Contains(t, strings.Join(a.Events, "\n"), "injected after its processor returned")
}

// accountWith returns the first account of r whose cause says cause.
func accountWith(t *testing.T, r onceflowtest.Report, cause string) onceflowtest.Account {
	t.Helper()
	for _, a := range r.Accounts {
		if strings.Contains(a.Cause, cause) {
			return a
		}
	}
	t.Fatalf("no account's cause says %q", cause)
	return onceflowtest.Account{}
}

// An interceptor that begins a transaction of its own and hands it to the processor commits the
// payment before the handler's transaction records the message id: a consumer that dies in
// between leaves the payment without its record, and the redelivery books it again.
func TestProve_CatchesAnInterceptorThatCommitsOnItsOwn(t *testing.T) {
	t.Parallel()
	var dbURL string
	if !onceflowtest.IsConsumer() {
		dbURL = testsvc.PostgresSchemaURL(t)
	}
	cfg := ledger(func(env onceflowtest.Env) onceflow.Handler {
		ownTx := onceflow.Use("own-tx", func(next processor.Processor) processor.Processor {
			return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
				tx, err := env.DB.BeginTxx(ctx, nil)
				if err != nil {
					return err
				}
				if err := next.Process(middleware.WithTx(ctx, tx), msg); err != nil {
					_ = tx.Rollback()
					return err
				}
				return tx.Commit()
			})
		})
		return onceflow.Handler{Name: "ledger", Topic: "payments", Subscriber: env.Subscriber, DB: env.DB,
			GroupCommit: perMessage,
			Chain:       onceflow.ExactlyOnce.Chain().After(onceflow.StageDeduplicate, ownTx), Processor: book}
	})
	cfg.DBURL = dbURL
	r, msg := proveBroken(t, cfg)
	require.Positive(t, r.CrashPoints[onceflowtest.BeforeCommit])
	require.Positive(t, r.Duplicated)
	require.Contains(t, msg, "applied 2 times")
	a := accountWith(t, r, "its consumer died before the handler's transaction committed, yet its effect stayed, and the redelivery applied it again")
	require.Contains(t, strings.Join(a.Events, "\n"), "died on it, at crash point before-commit")
}

// Without its deduplicate stage, an ExactlyOnce chain applies a second publish of a message,
// and a redelivery after the commit, again.
func TestProve_CatchesAChainWithoutDuplicateDetection(t *testing.T) {
	t.Parallel()
	r, msg := proveBroken(t, ledger(func(env onceflowtest.Env) onceflow.Handler {
		return onceflow.Handler{Name: "ledger", Topic: "payments", Subscriber: env.Subscriber, DB: env.DB,
			Chain: onceflow.ExactlyOnce.Chain().Remove(onceflow.StageDeduplicate, onceflow.AppliedTwice), Processor: book}
	}))
	require.GreaterOrEqual(t, r.Duplicated, r.Duplicates, "every message published twice is applied twice")
	require.Contains(t, msg, "published twice with the same id")
	require.NotContains(t, msg, "writes outside", "each effect came with an acknowledged delivery")
	require.Contains(t, msg, "the chain detects no duplicates (tracing -> metrics -> deadletter -> recover -> retry -> timeout -> transaction): keep the deduplicate stage")
}

// AtLeastOnce applies a message again when it comes back after its commit: with an effect that
// is not idempotent (an INSERT without a unique key), that is a second payment.
func TestProve_CatchesAnEffectNotIdempotentUnderAtLeastOnce(t *testing.T) {
	t.Parallel()
	r, msg := proveBroken(t, ledger(func(env onceflowtest.Env) onceflow.Handler {
		return onceflow.Handler{Name: "ledger", Topic: "payments", Subscriber: env.Subscriber, DB: env.DB,
			QoS: onceflow.AtLeastOnce, Processor: book}
	}))
	require.GreaterOrEqual(t, r.Duplicated, r.Duplicates)
	require.Contains(t, msg, "AtLeastOnce detects no duplicates: make the effect idempotent")
	require.NotContains(t, msg, "writes outside", "each effect came with an acknowledged delivery")
}

// The same test runs on a real broker and database, here RabbitMQ and PostgreSQL, with their
// connections cut; an ExactlyOnceInOrder handler's messages are applied in each key's order.
func TestProve_AnInOrderHandlerHoldsOnRabbitMQAndPostgreSQL(t *testing.T) {
	t.Parallel()
	cfg := ledger(func(env onceflowtest.Env) onceflow.Handler {
		return onceflow.Handler{Name: "ledger", Topic: "payments", Subscriber: env.Subscriber, DB: env.DB,
			QoS: onceflow.ExactlyOnceInOrder, Concurrency: 2, Processor: book}
	})
	if !onceflowtest.IsConsumer() {
		// A topic of its own on the shared broker; the run tells its consumers.
		cfg.BrokerURL, cfg.DBURL, cfg.Topic = testsvc.AMQPURL(t), testsvc.PostgresSchemaURL(t), testsvc.UniqueName("payments")
		t.Cleanup(func() { testsvc.RemoveTopics(t, cfg.BrokerURL, []string{"onceflowtest"}, cfg.Topic, cfg.Topic+"_dlq") })
	}
	cfg.Messages, cfg.Poison = 150, append(onceflowtest.DefaultPoison, onceflowtest.PoisonCrashLoop,
		onceflowtest.Poison{Name: "malformed", Message: onceflowtest.Message{Payload: []byte(`{"cents":`)}})
	// Until the crash-loop message, published first, reaches its delivery limit, it kills the
	// consumer that holds the other messages at every delivery (about 3 s each), and a delivery
	// given back during the database cut does not count: nothing may change for longer than the
	// default 30 s.
	cfg.Stall = time.Minute
	r := onceflowtest.Prove(t, cfg)
	require.NoError(t, r.Err())
	require.Equal(t, 2, r.Cuts)
	require.NotNil(t, r.OutOfOrder)
	require.Zero(t, *r.OutOfOrder)
	require.Equal(t, 4, r.Poison.Published, "panic, error, crash-loop and malformed; RabbitMQ carries no 300-byte id")
	require.Contains(t, r.Poison.Left["long-id"], "the broker does not carry it")
	require.Contains(t, r.Poison.Reasons["malformed"], "decode JSON payload")
	require.Positive(t, r.Poison.Kills, "the crash-loop message killed its consumers")
	out, err := json.Marshal(r)
	require.NoError(t, err)
	require.True(t, strings.Contains(string(out), `"order_violations":0`), string(out))
}
