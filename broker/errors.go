package broker

import "errors"

// ErrNotFound reports a topic or consumer group that does not exist on the broker, wrapped with
// its name: Peek, Move and Delete return it rather than an empty list, so that a mistyped name
// is told from a topic with nothing waiting.
var ErrNotFound = errors.New("not found")
