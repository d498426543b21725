package sqldb_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
)

// BenchmarkSQLiteGroupCommit_Autocheckpoint runs the write transactions of group commit on the
// embedded default, one after the other: 64 messages per transaction, each an id inserted into
// a table keyed as the dedup table is (with its expiry index) and a 1 KiB business row, on a
// file opened as Open leaves it and on one that copies its log back every 1,000 pages, SQLite's
// own default. It reports the slowest transaction too (one that copies the log). Run it
// with -benchtime 150000x or more: a short run measures the log's first growth.
func BenchmarkSQLiteGroupCommit_Autocheckpoint(b *testing.B) {
	const group = 64
	payload := []byte(strings.Repeat("x", 1024))
	for _, tc := range []struct{ name, query string }{
		{"open-default", ""},
		{"sqlite-default-1000", "?_pragma=wal_autocheckpoint(1000)"},
	} {
		b.Run(tc.name, func(b *testing.B) {
			ctx := context.Background()
			db := open(b, testsvc.SQLiteURL(b)+tc.query)
			mustExec(b, db, `CREATE TABLE processed (message_id TEXT NOT NULL, handler TEXT NOT NULL, message_ts BIGINT NOT NULL,
	internal_id TEXT, created_at BIGINT NOT NULL, expires_at BIGINT NOT NULL, PRIMARY KEY (message_id, handler, message_ts))`)
			mustExec(b, db, `CREATE INDEX processed_expires ON processed (expires_at)`)
			mustExec(b, db, `CREATE TABLE effects (message_id TEXT NOT NULL, payload BLOB)`)
			ids := make([]string, b.N)
			for i := range ids {
				ids[i] = fmt.Sprintf("%08x-4c1d-%04x-9e3a-%012d", i*2654435761%(1<<32), i%65536, i)
			}
			var slowest time.Duration
			b.ResetTimer()
			for i := 0; i < b.N; i += group {
				start := time.Now()
				chunk := ids[i:min(i+group, b.N)]
				var rec, eff strings.Builder
				rec.WriteString(`INSERT INTO processed (message_id, handler, message_ts, created_at, expires_at) VALUES `)
				eff.WriteString(`INSERT INTO effects (message_id, payload) VALUES `)
				recArgs, effArgs := make([]any, 0, 3*len(chunk)), make([]any, 0, 2*len(chunk))
				now := time.Now().UnixMicro()
				for j, id := range chunk {
					if j > 0 {
						rec.WriteByte(',')
						eff.WriteByte(',')
					}
					rec.WriteString("(?, 'billing', 0, ?, ?)")
					eff.WriteString("(?, ?)")
					recArgs = append(recArgs, id, now, now+int64(24*time.Hour/time.Microsecond))
					effArgs = append(effArgs, id, payload)
				}
				tx, err := db.BeginTxx(ctx, nil)
				require.NoError(b, err)
				_, err = tx.ExecContext(ctx, rec.String(), recArgs...)
				require.NoError(b, err)
				_, err = tx.ExecContext(ctx, eff.String(), effArgs...)
				require.NoError(b, err)
				require.NoError(b, tx.Commit())
				slowest = max(slowest, time.Since(start))
			}
			b.ReportMetric(float64(slowest.Microseconds())/1000, "slowest-ms")
		})
	}
}
