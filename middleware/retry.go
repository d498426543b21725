package middleware

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// RetryOption configures Retry.
type RetryOption interface{ applyRetry(*retryConfig) }

type retryOptionFunc func(*retryConfig)

func (f retryOptionFunc) applyRetry(c *retryConfig) { f(c) }

type retryConfig struct {
	maxAttempts     int
	initialInterval time.Duration
	maxInterval     time.Duration
	multiplier      float64
	onRetry         func(ctx context.Context, msg *messagedata.MessageData, err error)
	permanent       Classifier
}

// Retry defaults.
const (
	DefaultRetryMaxAttempts     = 3
	DefaultRetryInitialInterval = 100 * time.Millisecond
	DefaultRetryMaxInterval     = 5 * time.Second
)

// WithMaxAttempts sets how many times the chain inside runs for one delivery, the first attempt
// included. Defaults to DefaultRetryMaxAttempts. 1 disables retrying; less than 1 is an error
// of Retry.
func WithMaxAttempts(n int) RetryOption {
	return retryOptionFunc(func(c *retryConfig) { c.maxAttempts = n })
}

// WithBackoff sets the wait before the first retry and the longest wait between retries; the
// wait doubles from one retry to the next, with 50% jitter. Defaults to
// DefaultRetryInitialInterval and DefaultRetryMaxInterval. 0 and 0 retry at once; a negative
// wait, or a longest wait shorter than the first, is an error of Retry.
func WithBackoff(initial, max time.Duration) RetryOption {
	return retryOptionFunc(func(c *retryConfig) { c.initialInterval, c.maxInterval = initial, max })
}

// WithClassifier sets the Classifier that tells permanent errors from retryable ones.
// Defaults to DefaultClassifier.
func WithClassifier(c Classifier) RetryOption {
	return retryOptionFunc(func(cfg *retryConfig) { cfg.permanent = c })
}

// OnRetry registers fn, called before each retry with the error of the failed attempt.
func OnRetry(fn func(ctx context.Context, msg *messagedata.MessageData, err error)) RetryOption {
	return retryOptionFunc(func(c *retryConfig) { c.onRetry = fn })
}

// Retry runs the chain inside it again when it fails with a retryable error, waiting with
// exponential backoff between attempts.
//
// Every attempt re-runs everything inside Retry: placed outside Transaction, each attempt gets
// a fresh transaction. Retry does not retry a duplicate, a dead-lettered message, an attempt
// that failed because ctx ended, or a permanent error: an error that its Classifier
// (DefaultClassifier unless WithClassifier) finds permanent is returned at once, made
// processor.Permanent, so that DeadLetter outside dead-letters it on first sight. A panic
// passes through it. When the attempts are used up it returns the last error, and the router
// nacks the message so the broker redelivers it, after a delay that grows with its delivery
// count. Each attempt sees a copy of the message whose Attempt field counts from 1.
//
// It fails, naming the option, when an option's value is invalid.
func Retry(opts ...RetryOption) (Middleware, error) {
	cfg := retryConfig{
		maxAttempts:     DefaultRetryMaxAttempts,
		initialInterval: DefaultRetryInitialInterval,
		maxInterval:     DefaultRetryMaxInterval,
		multiplier:      2,
		permanent:       DefaultClassifier,
	}
	for _, o := range opts {
		o.applyRetry(&cfg)
	}
	if cfg.permanent == nil {
		cfg.permanent = DefaultClassifier
	}
	switch {
	case cfg.maxAttempts < 1:
		return nil, fmt.Errorf("Retry: WithMaxAttempts: %d is not a number of attempts (want at least 1)", cfg.maxAttempts)
	case cfg.initialInterval < 0 || cfg.maxInterval < 0:
		return nil, fmt.Errorf("Retry: WithBackoff: %s, %s: a wait is negative", cfg.initialInterval, cfg.maxInterval)
	case cfg.maxInterval < cfg.initialInterval:
		return nil, fmt.Errorf("Retry: WithBackoff: the longest wait %s is shorter than the first %s", cfg.maxInterval, cfg.initialInterval)
	}
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
				if cfg.permanent(err) {
					if !processor.IsPermanent(err) {
						err = processor.Permanent(err)
					}
					return err
				}
				if cur.Attempt >= cfg.maxAttempts {
					return err
				}
				if ctx.Err() != nil {
					return errors.Join(err, ctx.Err())
				}
				if bo == nil {
					bo = &backoff.ExponentialBackOff{
						InitialInterval:     cfg.initialInterval,
						RandomizationFactor: 0.5,
						Multiplier:          cfg.multiplier,
						MaxInterval:         cfg.maxInterval,
						MaxElapsedTime:      0,
						Stop:                backoff.Stop,
						Clock:               backoff.SystemClock,
					}
					bo.Reset()
				}
				if cfg.onRetry != nil {
					cfg.onRetry(ctx, cur, err)
				}
				RecordRetry(ctx)
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
