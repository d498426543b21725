package deadletter

import (
	"errors"
	"slices"
	"strings"
	"time"
)

// Filter chooses dead letters by what their headers say. Each field that is set must match;
// the zero Filter matches every dead letter.
type Filter struct {
	// Handler, when set, is the name of the handler that gave the message up, exactly.
	Handler string
	// Topic, when set, is the topic the message came from, exactly.
	Topic string
	// Reason, when set, is a part of the reason: case-sensitive, so that a whole reason
	// copied from a listing matches exactly that reason (and longer ones that contain it).
	Reason string
	// Since and Until, when set, bound when the message was dead-lettered: at Since or later,
	// before Until. A dead letter whose time is unknown matches no bound.
	Since, Until time.Time
}

// IsZero reports whether f matches every dead letter.
func (f Filter) IsZero() bool { return f == Filter{} }

// Match reports whether f chooses l.
func (f Filter) Match(l Letter) bool {
	switch {
	case f.Handler != "" && l.Handler != f.Handler,
		f.Topic != "" && l.Topic != f.Topic,
		f.Reason != "" && !strings.Contains(l.Reason, f.Reason),
		!f.Since.IsZero() && (l.Time.IsZero() || l.Time.Before(f.Since)),
		!f.Until.IsZero() && (l.Time.IsZero() || !l.Time.Before(f.Until)):
		return false
	}
	return true
}

// Selection chooses the dead letters that Replay and Delete act on: those with one of IDs, or
// All of them, and of those only the ones Filter matches.
type Selection struct {
	// IDs chooses the dead letters with one of these ids: a dead letter's ID, or its
	// OriginalID (the id of a message the dead letter could not carry).
	IDs []string
	// Exact makes each entry of IDs choose one dead letter, the oldest with that id not chosen
	// yet: an id listed twice chooses two. Set it to act on exactly the dead letters a List
	// showed, and not on one with the same id that arrived since (the same message
	// dead-lettered again). Without it, an id chooses every dead letter that has it.
	Exact bool
	// All chooses every dead letter, instead of IDs: it must be set for a Selection without
	// IDs, so that an empty Selection chooses nothing by mistake.
	All bool
	// Filter narrows the choice to the dead letters it matches.
	Filter Filter
}

// Validate reports a Selection that chooses neither by IDs nor All, or by both.
func (s Selection) Validate() error {
	switch {
	case len(s.IDs) == 0 && !s.All:
		return errors.New("deadletter: the selection chooses nothing: give IDs, or set All (with a Filter or not)")
	case len(s.IDs) > 0 && s.All:
		return errors.New("deadletter: the selection has IDs and All: choose by one of them")
	case slices.Contains(s.IDs, ""):
		return errors.New("deadletter: the selection has an empty id")
	}
	return nil
}

// chooser applies a Selection to dead letters in order, and remembers which ids it found.
type chooser struct {
	sel    Selection
	budget map[string]int // per id, how many dead letters it may still choose (Exact)
	found  map[string]bool
}

func newChooser(sel Selection) *chooser {
	c := &chooser{sel: sel, budget: map[string]int{}, found: map[string]bool{}}
	for _, id := range sel.IDs {
		c.budget[id]++
	}
	return c
}

// choose reports whether the selection chooses l, the next dead letter in order.
func (c *chooser) choose(l Letter) bool {
	if !c.sel.Filter.Match(l) {
		return false
	}
	if c.sel.All {
		return true
	}
	for _, id := range []string{l.ID, l.OriginalID} {
		if id == "" || c.budget[id] == 0 {
			continue
		}
		c.found[id] = true
		if c.sel.Exact {
			c.budget[id]--
		}
		return true
	}
	return false
}

// notFound returns the ids of the selection that chose no dead letter, sorted.
func (c *chooser) notFound() []string {
	out := []string{}
	for id := range c.budget {
		if !c.found[id] {
			out = append(out, id)
		}
	}
	slices.Sort(out)
	return out
}
