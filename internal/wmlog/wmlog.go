// Package wmlog adapts the *slog.Logger that onceflow's public API takes to the logger
// interface of the watermill adapters underneath.
package wmlog

import (
	"context"
	"log/slog"

	"github.com/ThreeDotsLabs/watermill"
)

// discard is the logger of a configuration that names none.
var discard = slog.New(slog.DiscardHandler)

// Discard returns a logger that writes nothing: the default of every Logger of the public API
// that says "Defaults to no logging".
func Discard() *slog.Logger { return discard }

// Adapter returns l as a watermill logger; a nil l, or one that discards, logs nothing at no
// cost.
func Adapter(l *slog.Logger) watermill.LoggerAdapter {
	if l == nil || l.Handler() == slog.DiscardHandler {
		return watermill.NopLogger{}
	}
	return watermill.NewSlogLogger(l)
}

// Quiet returns l with its info records written at debug, for the adapters that onceflow runs
// on the user's behalf (the outbox relay's queues), whose info logs are detail to the user; nil
// for a nil l.
func Quiet(l *slog.Logger) *slog.Logger {
	if l == nil {
		return nil
	}
	return slog.New(quiet{l.Handler()})
}

// quiet is a handler that writes info records at debug.
type quiet struct{ slog.Handler }

func (q quiet) Enabled(ctx context.Context, level slog.Level) bool {
	return q.Handler.Enabled(ctx, lower(level))
}

func (q quiet) Handle(ctx context.Context, r slog.Record) error {
	r.Level = lower(r.Level)
	return q.Handler.Handle(ctx, r)
}

func (q quiet) WithAttrs(attrs []slog.Attr) slog.Handler { return quiet{q.Handler.WithAttrs(attrs)} }
func (q quiet) WithGroup(name string) slog.Handler       { return quiet{q.Handler.WithGroup(name)} }

func lower(l slog.Level) slog.Level {
	if l == slog.LevelInfo {
		return slog.LevelDebug
	}
	return l
}
