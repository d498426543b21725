package sqlitequeue

import (
	"path/filepath"
	"strings"
	"sync"

	"github.com/onceflow/onceflow/broker/internal/dbqueue"
)

// fileWakes holds the wake-ups of each queue file's subscriptions in this process, by absolute
// path, for the life of the process, as sqldb keeps each file's turn to write.
var fileWakes sync.Map // string -> *dbqueue.Wakes

// wakesOf returns the wake-ups of the subscriptions of this process over the file at path,
// which every Queue over the file shares, so that a publish through one wakes the idle
// subscriptions of all; a database that is not a file has wake-ups of its own.
func wakesOf(path string) *dbqueue.Wakes {
	if path == "" || strings.HasPrefix(path, ":memory:") || strings.Contains(path, "mode=memory") {
		return &dbqueue.Wakes{}
	}
	if abs, err := filepath.Abs(path); err == nil {
		path = abs
	}
	w, _ := fileWakes.LoadOrStore(path, &dbqueue.Wakes{})
	return w.(*dbqueue.Wakes)
}
