package redelivery

import "context"

// A consumer that detects duplicates by position (onceflow's offsets mode) keeps, for each
// partition of an ordered log, the offset of the last message it applied, in its own
// database. It gives them to the subscriber on the context it subscribes with
// (WithPositions), and asks two things of a subscriber of an ordered log (Kafka) that finds
// them there (PositionsFrom):
//
//   - each partition's messages are handed out in offset order, one at a time: a message once
//     every message before it in its partition is acked, and a nacked message again before
//     the ones behind it, so that no two messages of a partition are processed at once and
//     none waits for another through retries;
//   - a partition assigned to the subscription starts after the offset applied last there
//     when the broker's own committed position is below it, so that the messages at or below
//     it are not even fetched. The broker's committed position then follows as acks arrive,
//     for lag monitoring.
//
// A consumer that applies a partition's consecutive messages in one transaction, in offset
// order (group commit), subscribes with WithPositionWindow instead: a partition's messages are
// then handed out in offset order several at once, each first delivery once every message
// before it that is not acked is handed out too, and a redelivery only once every message
// before it is acked, so that a nacked message comes again before the ones behind it, which
// wait for it.

// Positions are a consumer's applied offsets in the partitions of a topic.
type Positions interface {
	// Applied returns, for each partition of topic where the consumer applied a message, the
	// offset of the last one. A partition it has no entry for starts where the broker says.
	Applied(ctx context.Context, topic string) (map[int32]int64, error)
}

type positionsKey struct{}

type positionsValue struct {
	p      Positions
	window bool
}

// WithPositions returns a copy of ctx, the context of a Subscribe call, that carries the
// consumer's positions and asks for a partition's messages in order, one at a time.
func WithPositions(ctx context.Context, p Positions) context.Context {
	return context.WithValue(ctx, positionsKey{}, positionsValue{p: p})
}

// WithPositionWindow is WithPositions for a consumer that applies a partition's consecutive
// messages in one transaction, in offset order: it asks for a partition's messages in order,
// several at once (see above).
func WithPositionWindow(ctx context.Context, p Positions) context.Context {
	return context.WithValue(ctx, positionsKey{}, positionsValue{p: p, window: true})
}

// PositionsFrom returns the positions in ctx, the context of a Subscribe call, and whether the
// consumer gave any (WithPositions, WithPositionWindow).
func PositionsFrom(ctx context.Context) (Positions, bool) {
	v, ok := ctx.Value(positionsKey{}).(positionsValue)
	return v.p, ok && v.p != nil
}

// PositionWindow reports whether ctx, the context of a Subscribe call, asks for a partition's
// messages several at once (WithPositionWindow).
func PositionWindow(ctx context.Context) bool {
	v, ok := ctx.Value(positionsKey{}).(positionsValue)
	return ok && v.p != nil && v.window
}
