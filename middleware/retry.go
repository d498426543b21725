package middleware

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// Retry defaults.
const (
	DefaultRetryMaxAttempts     = 3
	DefaultRetryInitialInterval = 100 * time.Millisecond
	DefaultRetryMaxInterval     = 5 * time.Second
)

// Retry configures the retry stage: it runs the stages inside it again when they fail with a
// retryable error, waiting with exponential backoff between attempts. The zero value is the
// default configuration.
//
// Every attempt re-runs everything inside Retry: placed outside Transaction, each attempt gets
// a fresh transaction. Retry does not retry a duplicate, a dead-lettered message, an attempt
// that failed because ctx ended, or a permanent error: an error that the chain's dead-letter
// stage classifies as permanent (Delivery.Permanent: its Classifier, DefaultClassifier without
// one) is returned at once, made processor.Permanent, so that the dead-letter stage outside
// dead-letters it on first sight. Under the router, an outage (sqldb.IsOutage: the database
// unreachable or read-only) is returned at once too: the router gives the message back and
// pauses the handler until the outage is over. A panic passes through it. When the attempts are used up it
// returns the last error, and the router nacks the message so the broker redelivers it, after
// a delay that grows with its delivery count. Each attempt sees a copy of the message whose
// Attempt field counts from 1.
type Retry struct {
	// MaxAttempts is how many times the stages inside run for one delivery, the first attempt
	// included: 1 retries nothing. Defaults to DefaultRetryMaxAttempts.
	MaxAttempts int
	// InitialInterval is the wait before the first retry; it doubles from one retry to the
	// next, with 50% jitter, up to MaxInterval. Defaults to DefaultRetryInitialInterval (set
	// 1ns to retry at once).
	InitialInterval time.Duration
	// MaxInterval is the longest wait between attempts. Defaults to DefaultRetryMaxInterval, or
	// InitialInterval when that is longer.
	MaxInterval time.Duration
}

// Validate reports the first invalid field of r, by name.
func (r Retry) Validate() error {
	switch {
	case r.MaxAttempts < 0:
		return fmt.Errorf("MaxAttempts: %d is negative", r.MaxAttempts)
	case r.InitialInterval < 0:
		return fmt.Errorf("InitialInterval: %s is negative", r.InitialInterval)
	case r.MaxInterval < 0:
		return fmt.Errorf("MaxInterval: %s is negative", r.MaxInterval)
	case r.MaxInterval > 0 && r.withDefaults().InitialInterval > r.MaxInterval:
		return fmt.Errorf("MaxInterval: %s is shorter than the first wait, %s (InitialInterval, or DefaultRetryInitialInterval when zero)",
			r.MaxInterval, r.withDefaults().InitialInterval)
	}
	return nil
}

// withDefaults returns r with its zero fields set to their defaults.
func (r Retry) withDefaults() Retry {
	r.MaxAttempts = cmp.Or(r.MaxAttempts, DefaultRetryMaxAttempts)
	r.InitialInterval = cmp.Or(r.InitialInterval, DefaultRetryInitialInterval)
	if r.MaxInterval == 0 {
		r.MaxInterval = max(r.InitialInterval, DefaultRetryMaxInterval)
	}
	return r
}

// Middleware returns the retry stage of r, or an error naming the first invalid field.
func (r Retry) Middleware() (Middleware, error) {
	if err := r.Validate(); err != nil {
		return nil, fmt.Errorf("Retry.%w", err)
	}
	cfg := r.withDefaults()
	return func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			// The first attempt sees msg itself; later ones a copy with the attempt number, so
			// that the caller's value is never written.
			cur := msg
			if cur.Attempt < 1 {
				cp := *msg
				cp.Attempt = 1
				cur = &cp
			}
			var bo *backoff.ExponentialBackOff
			for {
				err := next.Process(ctx, cur)
				if err == nil || processor.IsDuplicate(err) || processor.IsDeadLettered(err) || processor.IsPanic(err) {
					return err
				}
				if d, _ := DeliveryFrom(ctx); processor.IsPermanent(err) || d.Permanent(err) {
					if !processor.IsPermanent(err) {
						err = processor.Permanent(err)
					}
					return err
				}
				if cur.Attempt >= cfg.MaxAttempts {
					return err
				}
				if st := delivery.From(ctx); st != nil && st.GivesBackOutages && sqldb.IsOutage(err) {
					return err // the router pauses the handler: an attempt now would fail alike
				}
				if ctx.Err() != nil {
					return errors.Join(err, ctx.Err())
				}
				if bo == nil {
					bo = &backoff.ExponentialBackOff{
						InitialInterval:     cfg.InitialInterval,
						RandomizationFactor: 0.5,
						Multiplier:          2,
						MaxInterval:         cfg.MaxInterval,
						MaxElapsedTime:      0,
						Stop:                backoff.Stop,
						Clock:               backoff.SystemClock,
					}
					bo.Reset()
				}
				if st := delivery.From(ctx); st != nil {
					st.Retries++
				}
				timer := time.NewTimer(bo.NextBackOff())
				select {
				case <-ctx.Done():
					timer.Stop()
					return errors.Join(err, ctx.Err())
				case <-timer.C:
				}
				again := *cur
				again.Attempt++
				cur = &again
			}
		})
	}, nil
}
