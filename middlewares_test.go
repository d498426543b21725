package onceflow_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/brokertest"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// A middleware value given to the handler runs where Interceptors names it: between Retry and
// Transaction, it sees every attempt, each outside its transaction.
func TestHandler_MiddlewaresTakeTheirPlaceInTheChain(t *testing.T) {
	f := newFixture(t, testsvc.Databases()[0])
	var attempts, inTx atomic.Int64
	audit := func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			attempts.Add(1)
			if _, ok := processor.TxFromContext(ctx); ok {
				inTx.Add(1)
			}
			return next.Process(ctx, msg)
		})
	}
	var calls atomic.Int64
	f.startRouter(t, onceflow.Handler{
		Interceptors: []string{"deadletter", "recover", "retry", "audit", "transaction", "deduplicate"},
		Middlewares:  map[string]middleware.Middleware{"audit": audit},
		Retry:        onceflow.RetryConfig{InitialInterval: 1, MaxInterval: 1},
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			if calls.Add(1) == 1 {
				return errors.New("transient")
			}
			return applyEffect(ctx, msg)
		}),
	})

	f.publish(t, "m-1", "x")
	f.waitAcks(t, "m-1", 1)
	require.Equal(t, int64(2), attempts.Load(), "inside Retry: once per attempt")
	require.Equal(t, int64(0), inTx.Load(), "outside Transaction")
	require.Equal(t, 1, countEffects(t, f.db, "m-1"))
	require.Equal(t, 0, f.broker.Nacks("m-1"))
}

func TestHandler_MiddlewaresThatCannotTakeAPlaceAreRefused(t *testing.T) {
	db := testsvc.SQLite(t)
	b := brokertest.New()
	noop := processor.Func(func(context.Context, *messagedata.MessageData) error { return nil })
	audit := middleware.Recover()
	for _, tt := range []struct {
		name         string
		interceptors []string
		mws          map[string]middleware.Middleware
		want         string
	}{
		{"not listed", []string{"transaction"}, map[string]middleware.Middleware{"audit": audit}, `Handler.Middlewares: "audit" is not listed in Interceptors`},
		{"without Interceptors", nil, map[string]middleware.Middleware{"audit": audit}, `Handler.Middlewares: "audit" is not listed in Interceptors`},
		{"a built-in's name", []string{"transaction"}, map[string]middleware.Middleware{"transaction": audit}, `Handler.Middlewares: "transaction" is the name of a built-in interceptor`},
		{"nil", []string{"audit", "transaction"}, map[string]middleware.Middleware{"audit": nil}, `Handler.Middlewares: "audit" is nil`},
		{"a registered interceptor's name", []string{"registered", "transaction"}, map[string]middleware.Middleware{"registered": audit}, `Handler.Middlewares: "registered" is the name of a registered interceptor too`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b})
			require.NoError(t, err)
			require.NoError(t, r.RegisterInterceptor("registered", func(onceflow.HandlerInfo) (middleware.Middleware, error) { return nil, nil }))
			err = r.AddHandler(onceflow.Handler{Name: "h", Topic: "t", Subscriber: b.Subscriber(), Processor: noop, QoS: onceflow.ExactlyOnce, DB: db,
				Interceptors: tt.interceptors, Middlewares: tt.mws})
			require.ErrorContains(t, err, tt.want)
		})
	}
}
