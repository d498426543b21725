package sqldb

import (
	"container/list"
	"context"
	"database/sql/driver"
	"reflect"
)

// An SQLite statement is compiled from its text every time database/sql runs it outside a
// prepared statement: for the INSERT of 64 keys that group commit records, parsing and planning
// cost about 2 of the 14 µs per key of the whole statement. The connections of an SQLite file
// therefore keep the statements they ran, by text, and run them again compiled (stmtCache).
// Statements come back: the application's, the dedup table's, the queue's.

// stmtCacheSize is the most statements one connection keeps compiled; the least recently used
// goes first. Group commit alone runs a text per group size for each of its multi-row
// statements.
const stmtCacheSize = 128

// stmtCache keeps the compiled statements of one connection. database/sql uses a connection
// from one goroutine at a time, which guards the cache too.
type stmtCache struct {
	byText map[string]*list.Element // of *cachedStmt
	lru    list.List                // most recently used first
}

// cachedStmt is a compiled statement of the cache.
type cachedStmt struct {
	text string
	stmt driver.Stmt
	// busy is set while rows of the statement are open: the statement cannot run again until
	// they are closed, and another run of its text compiles a statement of its own meanwhile.
	busy bool
	// evicted is set when the cache let the statement go while it was busy: the rows close it.
	evicted bool
}

// take returns the compiled statement of query, compiling it on conn if the cache has none,
// and marks it busy; nil when it cannot be had (busy, or the driver cannot run a compiled
// statement with a context), and the caller runs query the usual way, which also reports an
// error that compiling it would have had.
func (c *stmtCache) take(ctx context.Context, conn driver.Conn, query string) *cachedStmt {
	if e, ok := c.byText[query]; ok {
		cs := e.Value.(*cachedStmt)
		if cs.busy {
			return nil
		}
		c.lru.MoveToFront(e)
		cs.busy = true
		return cs
	}
	p, ok := conn.(driver.ConnPrepareContext)
	if !ok {
		return nil
	}
	stmt, err := p.PrepareContext(ctx, query)
	if err != nil {
		return nil
	}
	_, execs := stmt.(driver.StmtExecContext)
	_, queries := stmt.(driver.StmtQueryContext)
	if !execs || !queries {
		_ = stmt.Close()
		return nil
	}
	if c.byText == nil {
		c.byText = map[string]*list.Element{}
	}
	cs := &cachedStmt{text: query, stmt: stmt, busy: true}
	c.byText[query] = c.lru.PushFront(cs)
	for c.lru.Len() > stmtCacheSize {
		c.evict(c.lru.Back())
	}
	return cs
}

// done marks cs, which ran, free again; a statement evicted meanwhile is closed.
func (c *stmtCache) done(cs *cachedStmt) error {
	cs.busy = false
	if cs.evicted {
		return cs.stmt.Close()
	}
	return nil
}

// evict lets the statement of e go: closed now, or by its rows when they close.
func (c *stmtCache) evict(e *list.Element) {
	cs := e.Value.(*cachedStmt)
	c.lru.Remove(e)
	delete(c.byText, cs.text)
	cs.evicted = true
	if !cs.busy {
		_ = cs.stmt.Close()
	}
}

// close closes every statement of the cache, before the connection closes.
func (c *stmtCache) close() {
	for c.lru.Len() > 0 {
		c.evict(c.lru.Front())
	}
}

// exec runs query with args as a compiled statement of the cache; ok is false when the caller
// must run it the usual way.
func (c *stmtCache) exec(ctx context.Context, conn driver.Conn, query string, args []driver.NamedValue) (res driver.Result, ok bool, err error) {
	cs := c.take(ctx, conn, query)
	if cs == nil {
		return nil, false, nil
	}
	res, err = cs.stmt.(driver.StmtExecContext).ExecContext(ctx, args)
	if doneErr := c.done(cs); err == nil {
		err = doneErr
	}
	return res, true, err
}

// query runs query with args as a compiled statement of the cache, which stays busy until the
// rows close; ok is false when the caller must run it the usual way.
func (c *stmtCache) query(ctx context.Context, conn driver.Conn, query string, args []driver.NamedValue) (rows driver.Rows, ok bool, err error) {
	cs := c.take(ctx, conn, query)
	if cs == nil {
		return nil, false, nil
	}
	rows, err = cs.stmt.(driver.StmtQueryContext).QueryContext(ctx, args)
	if err != nil {
		_ = c.done(cs)
		return nil, true, err
	}
	return &cachedRows{Rows: rows, cache: c, cs: cs}, true, nil
}

// cachedRows are the rows of a cached statement: closing them frees the statement. They pass
// on the column types of the driver's rows.
type cachedRows struct {
	driver.Rows
	cache *stmtCache
	cs    *cachedStmt
}

var (
	_ driver.RowsColumnTypeDatabaseTypeName = (*cachedRows)(nil)
	_ driver.RowsColumnTypeLength           = (*cachedRows)(nil)
	_ driver.RowsColumnTypeNullable         = (*cachedRows)(nil)
	_ driver.RowsColumnTypePrecisionScale   = (*cachedRows)(nil)
	_ driver.RowsColumnTypeScanType         = (*cachedRows)(nil)
)

func (r *cachedRows) Close() error {
	err := r.Rows.Close()
	if r.cs != nil {
		if doneErr := r.cache.done(r.cs); err == nil {
			err = doneErr
		}
		r.cs = nil
	}
	return err
}

func (r *cachedRows) ColumnTypeDatabaseTypeName(index int) string {
	if t, ok := r.Rows.(driver.RowsColumnTypeDatabaseTypeName); ok {
		return t.ColumnTypeDatabaseTypeName(index)
	}
	return ""
}

func (r *cachedRows) ColumnTypeLength(index int) (int64, bool) {
	if t, ok := r.Rows.(driver.RowsColumnTypeLength); ok {
		return t.ColumnTypeLength(index)
	}
	return 0, false
}

func (r *cachedRows) ColumnTypeNullable(index int) (nullable, ok bool) {
	if t, ok := r.Rows.(driver.RowsColumnTypeNullable); ok {
		return t.ColumnTypeNullable(index)
	}
	return false, false
}

func (r *cachedRows) ColumnTypePrecisionScale(index int) (precision, scale int64, ok bool) {
	if t, ok := r.Rows.(driver.RowsColumnTypePrecisionScale); ok {
		return t.ColumnTypePrecisionScale(index)
	}
	return 0, 0, false
}

func (r *cachedRows) ColumnTypeScanType(index int) reflect.Type {
	if t, ok := r.Rows.(driver.RowsColumnTypeScanType); ok {
		return t.ColumnTypeScanType(index)
	}
	return reflect.TypeFor[any]()
}
