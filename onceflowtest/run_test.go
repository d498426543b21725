package onceflowtest_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/sqldb"
)

// The runs below fail before any consumer process starts: their command is never run.
var noConsumer = []string{"/nonexistent/consumer"}

func TestRun_RefusesAnIncompleteConfigNamingTheField(t *testing.T) {
	t.Parallel()
	full := ledger(func(env onceflowtest.Env) onceflow.Handler { return onceflow.Handler{} })
	full.Command = noConsumer
	for field, cfg := range map[string]onceflowtest.Config{
		"Config.Handler":  {Message: full.Message, Effects: full.Effects, Command: noConsumer},
		"Config.Message":  {Handler: full.Handler, Effects: full.Effects, Command: noConsumer},
		"Config.Effects":  {Handler: full.Handler, Message: full.Message, Command: noConsumer},
		"Config.Command":  {Handler: full.Handler, Message: full.Message, Effects: full.Effects},
		"Config.Poison":   {Handler: full.Handler, Message: full.Message, Effects: full.Effects, Command: noConsumer, Poison: []onceflowtest.Poison{{Name: "Not A Name"}}},
		"Config.Messages": {Handler: full.Handler, Message: full.Message, Effects: full.Effects, Command: noConsumer, Messages: -1},
	} {
		_, err := onceflowtest.Run(context.Background(), cfg)
		require.ErrorContains(t, err, field)
	}
}

// The run gives the handler its subscriber and its database, through its proxy: a handler that
// takes others would not be the one under faults.
func TestRun_RefusesAHandlerThatDoesNotTakeTheRunsDatabase(t *testing.T) {
	t.Parallel()
	cfg := ledger(func(env onceflowtest.Env) onceflow.Handler {
		other, err := sqldb.Open(context.Background(), "sqlite://"+t.TempDir()+"/other.db")
		require.NoError(t, err)
		t.Cleanup(func() { _ = other.Close() })
		return onceflow.Handler{Name: "ledger", Topic: "payments", Subscriber: env.Subscriber, DB: other, QoS: onceflow.ExactlyOnce, Processor: book}
	})
	cfg.Command, cfg.Dir = noConsumer, t.TempDir()
	_, err := onceflowtest.Run(context.Background(), cfg)
	require.ErrorContains(t, err, "Handler.DB: not the Env's DB")
}

// A handler that the router refuses is refused by the run, with the router's error, before any
// consumer starts.
func TestRun_RefusesAnInvalidHandlerWithTheRoutersError(t *testing.T) {
	t.Parallel()
	cfg := ledger(func(env onceflowtest.Env) onceflow.Handler {
		return onceflow.Handler{Name: "ledger", Topic: "payments", Subscriber: env.Subscriber, DB: env.DB,
			Chain: onceflow.ExactlyOnce.Chain().Remove(onceflow.StageDeduplicate), Processor: book}
	})
	cfg.Command, cfg.Dir = noConsumer, t.TempDir()
	_, err := onceflowtest.Run(context.Background(), cfg)
	require.ErrorContains(t, err, "the handler under test: Handler.Chain: Remove(deduplicate): ExactlyOnce promises that a message is applied once; pass onceflow.AppliedTwice to give that up")
}

// Messages must have ids of their own: the effects are counted per id.
func TestRun_RefusesTwoMessagesWithOneID(t *testing.T) {
	t.Parallel()
	cfg := ledger(func(env onceflowtest.Env) onceflow.Handler {
		return onceflow.Handler{Name: "ledger", Topic: "payments", Subscriber: env.Subscriber, DB: env.DB, QoS: onceflow.ExactlyOnce, Processor: book}
	})
	cfg.Message = func(i int) onceflowtest.Message {
		return onceflowtest.Message{ID: fmt.Sprintf("payment-%d", i%3), Payload: []byte(`{}`)}
	}
	cfg.Command, cfg.Dir = noConsumer, t.TempDir()
	_, err := onceflowtest.Run(context.Background(), cfg)
	require.ErrorContains(t, err, `Config.Message: messages 0 and 3 have the same id "payment-0"`)
}
