// Package urlparam checks the query parameters of a broker or database URL against the table
// of those its scheme takes, for package broker and package sqldb alike: a parameter that
// nobody reads is an error that names it and lists the known ones, not a setting silently
// ignored.
package urlparam

import (
	"fmt"
	"maps"
	"net/url"
	"slices"
	"strings"
)

// Group is the query parameters that one reader of a URL takes: onceflow, a scheme's package,
// or the client library under it.
type Group struct {
	// Reader names who reads them, for errors: "onceflow", "broker/amqp", "amqp091-go".
	Reader string
	// Names are the parameters, as written in the URL.
	Names []string
}

// Table is the query parameters of one URL scheme.
type Table struct {
	// Scheme is the canonical scheme, for errors.
	Scheme string
	// Groups are the known parameters, by reader, in the order errors list them.
	Groups []Group
	// Others, when not empty, says what a parameter outside Groups is taken for, by whom, and
	// who refuses one that is unknown ("PostgreSQL run-time settings, which the server checks
	// at connect"): Check lets such parameters through.
	Others string
}

// Has reports whether name is one of the table's known parameters.
func (t Table) Has(name string) bool {
	for _, g := range t.Groups {
		if slices.Contains(g.Names, name) {
			return true
		}
	}
	return false
}

// Check returns an *UnknownError for the first parameter of q, in sorted order, that the table
// does not know, unless the table lets others through.
func (t Table) Check(q url.Values) error {
	if t.Others != "" {
		return nil
	}
	for _, k := range slices.Sorted(maps.Keys(q)) {
		if !t.Has(k) {
			return &UnknownError{Param: k, Table: t}
		}
	}
	return nil
}

// Under returns t with g first: the parameters that a layer above the table's reader takes out
// of the URL before it reaches that reader. A name of g that t has already is left out of t.
func (t Table) Under(g Group) Table {
	out := Table{Scheme: t.Scheme, Others: t.Others, Groups: []Group{g}}
	for _, og := range t.Groups {
		var names []string
		for _, n := range og.Names {
			if !slices.Contains(g.Names, n) {
				names = append(names, n)
			}
		}
		if len(names) > 0 {
			out.Groups = append(out.Groups, Group{Reader: og.Reader, Names: names})
		}
	}
	return out
}

// known lists the table's parameters by reader, for errors.
func (t Table) known() string {
	var parts []string
	for _, g := range t.Groups {
		if len(g.Names) > 0 {
			parts = append(parts, g.Reader+"'s "+strings.Join(g.Names, ", "))
		}
	}
	if len(parts) == 0 {
		parts = append(parts, "none")
	}
	s := strings.Join(parts, "; ")
	if t.Others != "" {
		s += "; and " + t.Others
	}
	return s
}

// UnknownError reports a query parameter that no reader of the URL takes: one the table does
// not know, or one passed on to a server that refused it (Cause).
type UnknownError struct {
	// Param is the parameter, as written in the URL.
	Param string
	// Table is the scheme's table.
	Table Table
	// Cause, when not nil, is the refusal of the server the parameter was passed on to.
	Cause error
}

func (e *UnknownError) Error() string {
	msg := fmt.Sprintf("unknown query parameter %q (%s:// takes %s)", e.Param, e.Table.Scheme, e.Table.known())
	if e.Cause != nil {
		msg += ": " + e.Cause.Error()
	}
	return msg
}

func (e *UnknownError) Unwrap() error { return e.Cause }
