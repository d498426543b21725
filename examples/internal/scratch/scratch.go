// Package scratch gives an example a database of its own run on the server a URL names, so that
// the example runs again and again on a shared server and touches nothing else there: a new
// schema on PostgreSQL, a new database on MySQL and MariaDB, dropped when the run ends. An
// SQLite URL names a file, which is the run's own already.
//
// It keeps the examples' own code plain: they create their tables under fixed names, use
// onceflow's tables under their default names, and count what they wrote, as a program with a
// database of its own does.
package scratch

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"

	"github.com/onceflow/onceflow/sqldb"
)

// Run runs fn with a directory and a database of this run's own: dir, or when it is empty a new
// temporary directory, removed when fn returns; and Database's URL for rawURL in it, dropped when
// fn returns.
func Run(dir, rawURL string, fn func(ctx context.Context, dir, dbURL string) error) error {
	ctx := context.Background()
	if dir == "" {
		tmp, err := os.MkdirTemp("", "onceflow-example-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		dir = tmp
	}
	dbURL, drop, err := Database(ctx, rawURL, dir)
	if err != nil {
		return err
	}
	return errors.Join(fn(ctx, dir, dbURL), drop())
}

// Database returns the URL of a schema (PostgreSQL) or database (MySQL, MariaDB) made for this
// run on the server rawURL names, and drop, which removes it with everything in it. For an
// SQLite URL it returns rawURL and a drop that does nothing; an empty rawURL is the SQLite file
// app.db in dir. The user of rawURL needs the right to create schemas or databases.
func Database(ctx context.Context, rawURL, dir string) (runURL string, drop func() error, err error) {
	if rawURL == "" {
		rawURL = "sqlite://" + filepath.Join(dir, "app.db")
	}
	admin, err := sqldb.Open(ctx, rawURL)
	if err != nil {
		return "", nil, err
	}
	var name, create, dropStmt string
	u, err := url.Parse(rawURL)
	if err != nil {
		return "", nil, fmt.Errorf("database URL %s: %w", sqldb.Redact(rawURL), err)
	}
	switch admin.Dialect {
	case sqldb.SQLite:
		return rawURL, func() error { return nil }, admin.Close()
	case sqldb.Postgres:
		name = newName()
		create, dropStmt = "CREATE SCHEMA "+name, "DROP SCHEMA IF EXISTS "+name+" CASCADE"
		q := u.Query()
		q.Set("search_path", name)
		u.RawQuery = q.Encode()
	case sqldb.MySQL:
		name = newName()
		create, dropStmt = "CREATE DATABASE "+name, "DROP DATABASE IF EXISTS "+name
		u.Path = "/" + name
	}
	if _, err := admin.ExecContext(ctx, create); err != nil {
		return "", nil, fmt.Errorf("%s on %s: %w", create, admin, err)
	}
	drop = func() error {
		defer admin.Close()
		if _, err := admin.ExecContext(context.WithoutCancel(ctx), dropStmt); err != nil {
			return fmt.Errorf("%s on %s: %w", dropStmt, admin, err)
		}
		return nil
	}
	return u.String(), drop, nil
}

// newName returns a name no earlier run has used, valid as a schema or database name.
func newName() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return "onceflow_example_" + hex.EncodeToString(b[:])
}
