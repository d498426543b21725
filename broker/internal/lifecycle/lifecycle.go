// Package lifecycle is the life of broker/'s values that are open until closed (a Broker, a
// Subscriber's subscriptions, the SQLite queue, a publisher): what they hand out that closes
// with them, the calls in progress that their Close waits for, and the moment they close.
package lifecycle

import "sync"

// Set holds the members of type T of a value until it closes (the subscribers it made), and
// counts its calls in progress (Publish). Once Close has begun it takes neither. The zero value
// is open; a Set is safe for concurrent use.
type Set[T comparable] struct {
	mu      sync.Mutex
	closed  bool
	members map[T]struct{}
	calls   sync.WaitGroup
}

// Closed reports whether Close has begun.
func (s *Set[T]) Closed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// Add adds m and reports true, or reports false once Close has begun.
func (s *Set[T]) Add(m T) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	if s.members == nil {
		s.members = map[T]struct{}{}
	}
	s.members[m] = struct{}{}
	return true
}

// Remove removes m, a member that closed by itself.
func (s *Set[T]) Remove(m T) {
	s.mu.Lock()
	delete(s.members, m)
	s.mu.Unlock()
}

// Enter begins a call and reports true, or reports false once Close has begun. A call that
// began ends with Leave.
func (s *Set[T]) Enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.calls.Add(1)
	return true
}

// Leave ends a call that Enter began.
func (s *Set[T]) Leave() { s.calls.Done() }

// Close begins the end: no member or call is taken from then on. The first Close returns the
// members, for the caller to close, and first true; a later one returns none and false.
func (s *Set[T]) Close() (members []T, first bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, false
	}
	s.closed = true
	for m := range s.members {
		members = append(members, m)
	}
	return members, true
}

// Wait waits for the calls in progress to Leave.
func (s *Set[T]) Wait() { s.calls.Wait() }
