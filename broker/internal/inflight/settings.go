package inflight

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/wmlog"
)

// Settings are the settings that every subscriber's Config has, under the names of Rules, as
// Rules.Validate checks them: how many deliveries a subscription holds, how long one may stay
// unsettled, how long a nack waits, and how long Close may take.
type Settings struct {
	Prefetch     int
	AckTimeout   time.Duration
	NackDelay    time.Duration
	CloseTimeout time.Duration
}

// Rules say how one scheme reads its Settings: the defaults that a zero value selects, the
// bounds, and the names the fields have in its Config, for the errors.
type Rules struct {
	// Scheme prefixes every error, and Struct (Config when empty) names the fields' struct:
	// "redis" gives "redis: Config.Prefetch: ...".
	Scheme, Struct string

	// Prefetch is the default window; MaxPrefetch, when not zero, bounds it. PrefetchField
	// names the field in the Config ("Prefetch" when empty).
	Prefetch, MaxPrefetch int
	PrefetchField         string

	// AckTimeout is the default of Settings.AckTimeout; zero for a scheme whose deliveries
	// have no deadline (Settings.AckTimeout is then not read). AckTimeoutField names the
	// field in the Config ("AckTimeout" when empty); MinAckTimeout, when not zero, is the
	// shortest one accepted.
	AckTimeout      time.Duration
	AckTimeoutField string
	MinAckTimeout   time.Duration

	// NackDelay is the default of Settings.NackDelay. With NoNackDelay, -1 as NackDelay
	// means no delay (the default being another); without, a zero NackDelay means no delay.
	NackDelay   time.Duration
	NoNackDelay bool

	// CloseTimeout is the default of Settings.CloseTimeout.
	CloseTimeout time.Duration
}

// Duration is a duration field of a scheme's Config beside its Settings, whose zero selects
// a default: Rules.Validate refuses it negative, or not zero and shorter than Min.
type Duration struct {
	Name       string
	Value, Min time.Duration
}

// Validate reports the first field of s that the scheme refuses, or else the first of more
// that is negative, naming it.
func (r Rules) Validate(s Settings, more ...Duration) error {
	prefix := r.Scheme + ": " + cmp.Or(r.Struct, "Config") + "."
	if s.Prefetch < 0 || r.MaxPrefetch > 0 && s.Prefetch > r.MaxPrefetch {
		prefetch := prefix + cmp.Or(r.PrefetchField, "Prefetch")
		if r.MaxPrefetch > 0 {
			return fmt.Errorf("%s: %d is outside 1..%d (0 selects the default)", prefetch, s.Prefetch, r.MaxPrefetch)
		}
		return fmt.Errorf("%s: %d is negative (0 selects the default)", prefetch, s.Prefetch)
	}
	switch {
	case s.NackDelay < 0 && !(r.NoNackDelay && s.NackDelay == -1):
		if r.NoNackDelay {
			return fmt.Errorf("%sNackDelay: %s is negative (0 selects the default, NoNackDelay disables the delay)", prefix, s.NackDelay)
		}
		return fmt.Errorf("%sNackDelay: %s is negative (0 redelivers at once)", prefix, s.NackDelay)
	case s.CloseTimeout < 0:
		return fmt.Errorf("%sCloseTimeout: %s is negative (0 selects the default)", prefix, s.CloseTimeout)
	}
	ackTimeout := prefix + cmp.Or(r.AckTimeoutField, "AckTimeout")
	switch {
	case r.AckTimeout == 0: // the scheme's deliveries have no deadline: not read
	case s.AckTimeout < 0:
		return fmt.Errorf("%s: %s is negative (0 selects the default)", ackTimeout, s.AckTimeout)
	case s.AckTimeout > 0 && s.AckTimeout < r.MinAckTimeout:
		return fmt.Errorf("%s: %s is shorter than %s", ackTimeout, s.AckTimeout, r.MinAckTimeout)
	}
	for _, d := range more {
		switch {
		case d.Value < 0:
			return fmt.Errorf("%s%s: %s is negative (0 selects the default)", prefix, d.Name, d.Value)
		case d.Value > 0 && d.Value < d.Min:
			return fmt.Errorf("%s%s: %s is shorter than %s (0 selects the default)", prefix, d.Name, d.Value, d.Min)
		}
	}
	return nil
}

// Window returns the window of one subscription whose Config's prefetch is prefetch (0 when
// its user left it unset), subscribed with ctx: prefetch when set, otherwise the scheme's
// default, or the window the consumer asks for (redelivery.WithWindow) when that is larger,
// within MaxPrefetch.
func (r Rules) Window(ctx context.Context, prefetch int) int {
	if prefetch > 0 {
		return prefetch
	}
	return redelivery.WindowFrom(ctx, r.Prefetch, r.MaxPrefetch)
}

// Fields point at the fields of a scheme's Config that hold its Settings, and at the
// watermill adapter of its Logger. AckTimeout may be nil when the Rules have no AckTimeout.
type Fields struct {
	Prefetch                            *int
	AckTimeout, NackDelay, CloseTimeout *time.Duration
	Logger                              **slog.Logger
	Log                                 *watermill.LoggerAdapter
}

// Settings returns the Settings that f points at.
func (f Fields) Settings() Settings {
	s := Settings{Prefetch: *f.Prefetch, NackDelay: *f.NackDelay, CloseTimeout: *f.CloseTimeout}
	if f.AckTimeout != nil {
		s.AckTimeout = *f.AckTimeout
	}
	return s
}

// Default sets every zero field that f points at but Prefetch (each subscription takes its
// own Window) to the scheme's default, NackDelay to the delay it stands for, and Log to the
// adapter of the Logger.
func (r Rules) Default(f Fields) {
	switch {
	case r.NoNackDelay && *f.NackDelay == -1:
		*f.NackDelay = 0
	case *f.NackDelay == 0:
		*f.NackDelay = r.NackDelay
	}
	if f.AckTimeout != nil {
		*f.AckTimeout = cmp.Or(*f.AckTimeout, r.AckTimeout)
	}
	*f.CloseTimeout = cmp.Or(*f.CloseTimeout, r.CloseTimeout)
	*f.Logger = cmp.Or(*f.Logger, wmlog.Discard())
	*f.Log = wmlog.Adapter(*f.Logger)
}
