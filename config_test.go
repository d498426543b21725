package onceflow_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/brokertest"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

func TestNewRouter_InvalidConfigNamesTheField(t *testing.T) {
	b := brokertest.New()
	tests := []struct {
		name string
		cfg  onceflow.Config
		want string
	}{
		{"no dead-letter publisher", onceflow.Config{}, "Config.DeadLetterPublisher: nil"},
		{"bad dead-letter topic", onceflow.Config{DeadLetterPublisher: b, DeadLetterTopic: "dead letters"}, "Config.DeadLetterTopic"},
		{"negative close timeout", onceflow.Config{DeadLetterPublisher: b, CloseTimeout: -1}, "Config.CloseTimeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := onceflow.NewRouter(tt.cfg)
			require.ErrorContains(t, err, tt.want)
		})
	}
}

func TestAddHandler_InvalidHandlerNamesTheField(t *testing.T) {
	db := testsvc.SQLite(t)
	b := brokertest.New()
	noop := processor.Func(func(context.Context, *messagedata.MessageData) error { return nil })
	valid := func() onceflow.Handler {
		return onceflow.Handler{Name: "h", Topic: "t", Subscriber: b.Subscriber(), Processor: noop, QoS: onceflow.ExactlyOnce, DB: db}
	}
	tests := []struct {
		name   string
		modify func(*onceflow.Handler)
		want   string
	}{
		{"empty handler name", func(h *onceflow.Handler) { h.Name = "" }, "Handler.Name: empty"},
		{"empty topic", func(h *onceflow.Handler) { h.Topic = "" }, "Handler.Topic: empty"},
		{"nil subscriber", func(h *onceflow.Handler) { h.Subscriber = nil }, "Handler.Subscriber: nil"},
		{"nil processor", func(h *onceflow.Handler) { h.Processor = nil }, "Handler.Processor: nil"},
		{"unknown QoS", func(h *onceflow.Handler) { h.QoS = 42 }, "Handler.QoS: QoS(42) is not a quality of service"},
		{"missing QoS", func(h *onceflow.Handler) { h.QoS = 0 }, "Handler.QoS"},
		{"nil database", func(h *onceflow.Handler) { h.DB = nil }, "Handler.DB: nil"},
		{"table name not an identifier", func(h *onceflow.Handler) { h.Dedup.Table = "dedup; DROP TABLE x" }, `Handler.Dedup.Table: "dedup; DROP TABLE x" is not a plain SQL identifier`},
		{"negative concurrency", func(h *onceflow.Handler) { h.Concurrency = -1 }, "Handler.Concurrency"},
		{"longest retry wait below the first", func(h *onceflow.Handler) {
			h.Retry = middleware.Retry{InitialInterval: time.Second, MaxInterval: time.Millisecond}
		}, "Handler.Retry.MaxInterval: 1ms is shorter than the first wait, 1s"},
		{"an edit naming a stage the chain does not hold", func(h *onceflow.Handler) {
			h.Chain = onceflow.ExactlyOnce.Chain().Before("retri", onceflow.Use("audit", middleware.Recover()))
		}, `Handler.Chain: Before(retri, audit): the chain has no stage "retri"`},
		{"a chain of another QoS", func(h *onceflow.Handler) { h.Chain = onceflow.AtLeastOnce.Chain() },
			"Handler.QoS: ExactlyOnce, but Handler.Chain is the chain of AtLeastOnce"},
		{"deduplicate without the transaction", func(h *onceflow.Handler) {
			h.Chain = onceflow.ExactlyOnce.Chain().Remove(onceflow.StageTransaction, onceflow.PartlyApplied)
		}, "Handler.Chain: stage deduplicate writes through the transaction, and the chain has no transaction stage"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b})
			require.NoError(t, err)
			h := valid()
			tt.modify(&h)
			require.ErrorContains(t, r.AddHandler(h), tt.want)
		})
	}

	t.Run("duplicate handler name", func(t *testing.T) {
		r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b})
		require.NoError(t, err)
		require.NoError(t, r.AddHandler(valid()))
		require.ErrorContains(t, r.AddHandler(valid()), `Handler.Name: "h" is already used`)
	})
}

func TestParseQoS(t *testing.T) {
	for in, want := range map[string]onceflow.QoS{
		"ExactlyOnce": onceflow.ExactlyOnce, "exactly-once": onceflow.ExactlyOnce, "at_least_once": onceflow.AtLeastOnce,
		"besteffort": onceflow.BestEffort, "ExactlyOnceInOrder": onceflow.ExactlyOnceInOrder,
	} {
		got, err := onceflow.ParseQoS(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	_, err := onceflow.ParseQoS("twice")
	require.ErrorContains(t, err, `unknown quality of service "twice"`)
}
