package main

import (
	"errors"
	"hash/fnv"
	"sync"
	"sync/atomic"
)

// errInjected is the failure of the reruns scenario: an error the retry interceptor retries.
var errInjected = errors.New("injected failure")

// faults chooses the messages that fail once in the reruns scenario: 1 in every, by a hash of
// the message id, so that every variant's processor chooses the same ones whatever the order
// its messages come in. A nil *faults chooses none.
type faults struct {
	every  uint32
	failed sync.Map // message id -> struct{}: the chosen messages that have failed
	count  atomic.Int64
}

// fail reports whether the run of the processor for the message id must fail: the first run
// of a chosen message, never a later one.
func (f *faults) fail(id string) bool {
	if f == nil {
		return false
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(id))
	if h.Sum32()%f.every != 0 {
		return false
	}
	if _, loaded := f.failed.LoadOrStore(id, struct{}{}); loaded {
		return false
	}
	f.count.Add(1)
	return true
}

// injected returns how many messages have failed.
func (f *faults) injected() int64 { return f.count.Load() }
