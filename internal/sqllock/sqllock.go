// Package sqllock takes named, session-scoped locks that exclude the other processes sharing a
// database, without waiting: PostgreSQL advisory locks, MySQL and MariaDB named locks
// (GET_LOCK), and, for SQLite, an flock on a file beside the database file. Background jobs
// that must run on one node at a time (the dedup purge, the gap sweeper of package ordering)
// take one for the length of a run; TryLockFile is the file lock alone, for the SQLite outbox
// relay's turns.
package sqllock

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/onceflow/onceflow/sqldb"
)

// releaseTimeout bounds the release of a lock, which runs even when the caller's context has
// ended.
const releaseTimeout = 10 * time.Second

// pgKey is an advisory lock key for the name ($1) in the current schema: the first 64 bits of an
// MD5, so that two schemas of one database do not exclude each other.
const pgKey = `('x' || substr(md5('onceflow.lock.' || coalesce(current_schema(), '') || '.' || $1::text), 1, 16))::bit(64)::bigint`

// mysqlName is a GET_LOCK name for the name (?) in the current database. Named locks are
// server-wide, hence the database in the name; hashed, because names are limited to 64
// characters.
const mysqlName = `CONCAT('onceflow.lock.', SHA1(CONCAT(IFNULL(DATABASE(), ''), '.', ?)))`

// memLocks stand in for the file lock of SQLite databases without a file (in memory): the
// processes cannot share those, so a lock within the process, per database, is enough.
var memLocks sync.Map // memLock -> *sync.Mutex

type memLock struct {
	db   *sqldb.DB
	name string
}

// TryLock takes the lock called name on db without waiting. When another session (another
// process, or another connection of this one) holds it, held is false and release is nil.
// Otherwise the lock is held until release is called, or until the session ends: a process that
// dies loses its locks.
//
// name must be plain ASCII without a path separator; it is part of a file name on SQLite.
func TryLock(ctx context.Context, db *sqldb.DB, name string) (release func() error, held bool, err error) {
	if name == "" || strings.ContainsAny(name, `/\`) {
		return nil, false, fmt.Errorf("sqllock: invalid lock name %q", name)
	}
	switch db.Dialect {
	case sqldb.Postgres:
		return tryServer(ctx, db, `SELECT pg_try_advisory_lock(`+pgKey+`)`, `SELECT pg_advisory_unlock(`+pgKey+`)`, name)
	case sqldb.MySQL:
		return tryServer(ctx, db, `SELECT GET_LOCK(`+mysqlName+`, 0) = 1`, `SELECT RELEASE_LOCK(`+mysqlName+`) = 1`, name)
	case sqldb.SQLite:
		return tryFile(db, name)
	}
	return nil, false, fmt.Errorf("sqllock: unsupported dialect %q", db.Dialect)
}

// tryServer takes a session lock on a connection of its own, which it keeps until release.
func tryServer(ctx context.Context, db *sqldb.DB, lock, unlock, name string) (func() error, bool, error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return nil, false, err
	}
	var got sql.NullBool
	if err := conn.QueryRowContext(ctx, lock, name).Scan(&got); err != nil {
		discard(conn)
		return nil, false, err
	}
	if !got.Valid {
		discard(conn)
		return nil, false, errors.New("sqllock: the lock function returned NULL")
	}
	if !got.Bool {
		return nil, false, conn.Close()
	}
	release := func() error {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
		defer cancel()
		var released sql.NullBool
		err := conn.QueryRowContext(ctx, unlock, name).Scan(&released)
		if err == nil && !released.Bool {
			err = errors.New("the lock was not held")
		}
		if err != nil {
			// A connection that may still hold the lock must not go back to the pool: closing
			// it ends the session, and the server releases the lock.
			discard(conn)
			return fmt.Errorf("sqllock: release %q: %w", name, err)
		}
		return conn.Close()
	}
	return release, true, nil
}

// tryFile takes an exclusive flock on "<database file>.<name>.lock". The file is left in place
// when the lock is released: removing it would let two processes lock two different files of
// the same name.
func tryFile(db *sqldb.DB, name string) (func() error, bool, error) {
	if db.Path == "" || strings.HasPrefix(db.Path, ":memory:") {
		v, _ := memLocks.LoadOrStore(memLock{db, name}, &sync.Mutex{})
		mu := v.(*sync.Mutex)
		if !mu.TryLock() {
			return nil, false, nil
		}
		return func() error { mu.Unlock(); return nil }, true, nil
	}
	path := db.Path + "." + name + ".lock"
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, false, fmt.Errorf("sqllock: %w", err)
	}
	held, err := TryLockFile(f)
	if err != nil || !held {
		_ = f.Close()
		if err != nil {
			return nil, false, fmt.Errorf("sqllock: lock %s: %w", path, err)
		}
		return nil, false, nil
	}
	release := func() error {
		uerr := UnlockFile(f)
		if cerr := f.Close(); uerr == nil {
			uerr = cerr
		}
		if uerr != nil {
			return fmt.Errorf("sqllock: unlock %s: %w", path, uerr)
		}
		return nil
	}
	return release, true, nil
}

// discard closes conn's underlying connection instead of returning it to the pool: the
// database ends the session and with it every lock the session held.
func discard(conn *sql.Conn) {
	_ = conn.Raw(func(any) error { return driver.ErrBadConn })
	_ = conn.Close()
}
