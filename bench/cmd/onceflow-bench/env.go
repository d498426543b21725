package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

// services are the URLs of the services a benchmark talks to, all on loopback by default.
type services struct {
	postgres, mysql, amqp, nats, redis string
	dir                                string // SQLite files
}

func defaultServices() services {
	env := func(name, def string) string {
		if v := os.Getenv(name); v != "" {
			return v
		}
		return def
	}
	return services{
		postgres: env("ONCEFLOW_TEST_POSTGRES", testsvc.DefaultPostgresURL),
		mysql:    env("ONCEFLOW_TEST_MYSQL", testsvc.DefaultMySQLURL),
		amqp:     env("ONCEFLOW_TEST_AMQP", testsvc.DefaultAMQPURL),
		nats:     env("ONCEFLOW_TEST_NATS", testsvc.DefaultNATSURL),
		redis:    env("ONCEFLOW_TEST_REDIS", testsvc.DefaultRedisURL),
	}
}

// benchPrefix begins the names of the bench's schemas and databases; the dedup-at-scale table,
// which later runs reuse, lives in benchPrefix + "_scale".
const benchPrefix = "onceflow_bench"

// benchSchema is the PostgreSQL schema, and benchDatabase the MariaDB database, that a run
// creates its tables in; both are created at the start of a run and dropped at its end. The
// process id in the names keeps two runs on one machine apart.
var (
	benchSchema   = fmt.Sprintf("%s_%d", benchPrefix, os.Getpid())
	benchDatabase = benchSchema
)

// withSearchPath returns the PostgreSQL URL base with its search_path set to schema.
func withSearchPath(base, schema string) string {
	u, err := url.Parse(base)
	if err != nil {
		return base
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String()
}

// withDatabase returns the MySQL URL base naming database name.
func withDatabase(base, name string) string {
	u, err := url.Parse(base)
	if err != nil {
		return base
	}
	u.Path = "/" + name
	return u.String()
}

// preparePostgres drops and creates the bench schema, and returns the URL that uses it.
func preparePostgres(ctx context.Context, base, schema string) (string, error) {
	admin, err := sqldb.Open(ctx, base)
	if err != nil {
		return "", err
	}
	defer admin.Close()
	for _, stmt := range []string{`DROP SCHEMA IF EXISTS ` + schema + ` CASCADE`, `CREATE SCHEMA ` + schema} {
		if _, err := admin.ExecContext(ctx, stmt); err != nil {
			return "", fmt.Errorf("%s: %w", stmt, err)
		}
	}
	return withSearchPath(base, schema), nil
}

// dropSchema drops a PostgreSQL schema and everything in it, ignoring errors.
func dropSchema(base, schema string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if admin, err := sqldb.Open(ctx, base); err == nil {
		_, _ = admin.ExecContext(ctx, `DROP SCHEMA IF EXISTS `+schema+` CASCADE`)
		_ = admin.Close()
	}
}

// dropDatabase drops a MariaDB database and everything in it, ignoring errors.
func dropDatabase(base, name string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if admin, err := sqldb.Open(ctx, base); err == nil {
		_, _ = admin.ExecContext(ctx, `DROP DATABASE IF EXISTS `+name)
		_ = admin.Close()
	}
}

// prepareMySQL drops and creates the bench database, and returns the URL that uses it.
func prepareMySQL(ctx context.Context, base, name string) (string, error) {
	admin, err := sqldb.Open(ctx, base)
	if err != nil {
		return "", err
	}
	defer admin.Close()
	for _, stmt := range []string{`DROP DATABASE IF EXISTS ` + name, `CREATE DATABASE ` + name} {
		if _, err := admin.ExecContext(ctx, stmt); err != nil {
			return "", fmt.Errorf("%s: %w", stmt, err)
		}
	}
	return withDatabase(base, name), nil
}

// newID returns a short random identifier, valid in table, topic and queue names.
func newID() string {
	var b [5]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// newPayload returns n printable bytes, the same for every message of a run.
func newPayload(n int) []byte {
	const alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
	raw := make([]byte, n)
	_, _ = rand.Read(raw)
	for i, c := range raw {
		raw[i] = alphabet[int(c)%len(alphabet)]
	}
	return raw
}

// numCPU is the number of cores of the machine.
var numCPU = runtime.NumCPU()

// Machine describes the machine a run measured on.
type Machine struct {
	CPU      string  `json:"cpu"`
	Cores    int     `json:"cores"`
	MemoryGB float64 `json:"memory_gb"`
	Kernel   string  `json:"kernel"`
	// LoadBefore and LoadAfter are the 1-minute load averages at the start and end of the run:
	// the machine is shared, and a load above the core count means others were busy too.
	LoadBefore float64 `json:"load_before"`
	LoadAfter  float64 `json:"load_after,omitempty"`
}

func describeMachine() Machine {
	m := Machine{Cores: runtime.NumCPU(), LoadBefore: loadAverage()}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for line := range strings.SplitSeq(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPU = strings.TrimSpace(v)
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		var kb float64
		if _, err := fmt.Sscanf(string(b), "MemTotal: %f kB", &kb); err == nil {
			m.MemoryGB = float64(int(kb/1024/1024*10)) / 10
		}
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(b))
	}
	return m
}

func loadAverage() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f, _ := strconv.ParseFloat(strings.Fields(string(b))[0], 64)
	return f
}

// versions returns the versions of the services and of the Go modules that matter.
func versions(ctx context.Context, svc services, setups []setup) map[string]string {
	v := map[string]string{"go": runtime.Version()}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			switch d.Path {
			case "github.com/ThreeDotsLabs/watermill", "github.com/ThreeDotsLabs/watermill-amqp/v2",
				"github.com/ThreeDotsLabs/watermill-nats/v2", "github.com/ThreeDotsLabs/watermill-redisstream",
				"github.com/jackc/pgx/v5", "github.com/go-sql-driver/mysql", "modernc.org/sqlite",
				"github.com/rabbitmq/amqp091-go", "github.com/nats-io/nats.go", "github.com/redis/go-redis/v9":
				v[d.Path] = d.Version
			}
		}
	}
	query := func(rawURL, q string) string {
		db, err := sqldb.Open(ctx, rawURL)
		if err != nil {
			return "unavailable: " + err.Error()
		}
		defer db.Close()
		var s string
		if err := db.QueryRowxContext(ctx, q).Scan(&s); err != nil {
			return "unknown: " + err.Error()
		}
		return s
	}
	uses := map[string]bool{}
	for _, s := range setups {
		uses[s.Database] = true
		uses[s.Broker] = true
	}
	if uses["postgres"] {
		v["postgresql"] = query(svc.postgres, `SHOW server_version`)
		if out, err := exec.CommandContext(ctx, "pgbench", "--version").Output(); err == nil {
			v["pgbench"] = strings.TrimSpace(string(out))
		}
	}
	if uses["mysql"] {
		v["mariadb"] = query(svc.mysql, `SELECT VERSION()`)
	}
	if uses["sqlite"] {
		path := filepath.Join(os.TempDir(), "onceflow-bench-version-"+newID()+".db")
		v["sqlite"] = query("sqlite://"+path, `SELECT sqlite_version()`)
		for _, f := range []string{path, path + "-wal", path + "-shm"} {
			_ = os.Remove(f)
		}
	}
	if uses["amqp"] {
		if conn, err := amqp.Dial(svc.amqp); err == nil {
			if s, ok := conn.Properties["version"].(string); ok {
				v["rabbitmq"] = s
			}
			_ = conn.Close()
		}
	}
	if uses["nats"] {
		if nc, err := nats.Connect(svc.nats); err == nil {
			v["nats-server"] = nc.ConnectedServerVersion()
			nc.Close()
		}
	}
	if uses["redis"] {
		if c, err := dialRedis(svc.redis, 0); err == nil {
			if info, err := c.Info(ctx, "server").Result(); err == nil {
				for line := range strings.SplitSeq(info, "\n") {
					if after, ok := strings.CutPrefix(strings.TrimSpace(line), "redis_version:"); ok {
						v["redis"] = after
					}
				}
			}
			_ = c.Close()
		}
	}
	return v
}

// cpuSample is the CPU time spent so far by the machine and by the processes of interest.
type cpuSample struct {
	at    time.Time
	busy  float64          // seconds of non-idle CPU time, all cores, since boot
	procs map[int]procTime // CPU time of each process alive now
}

type procTime struct {
	group string
	secs  float64
}

// clockTicks is the unit of /proc's CPU times (USER_HZ), 100 on every Linux we run on.
const clockTicks = 100

// cpuGroups are the process groups of cpuUse, and "machine" for the whole machine.
var cpuGroups = []string{"machine", "consumer", "rabbitmq", "nats", "redis", "postgres", "mariadb", "pgbench", "other"}

// brokerGroup is the process group of a setup's broker: the embedded SQLite queue runs in the
// consumer.
func brokerGroup(broker string) string {
	return map[string]string{"amqp": "rabbitmq", "nats": "nats", "redis": "redis"}[broker]
}

// databaseGroup is the process group of a setup's database; SQLite runs in the consumer.
func databaseGroup(database string) string {
	return map[string]string{"postgres": "postgres", "mysql": "mariadb"}[database]
}

// sampleCPU reads /proc/stat and the stat of every process, grouped: the bench process itself
// (the consumer), postgres, rabbitmq (the Erlang VM), nats (nats-server), redis (redis-server),
// mariadb, pgbench, and everything else.
func sampleCPU() cpuSample {
	s := cpuSample{at: time.Now(), procs: map[int]procTime{}}
	if b, err := os.ReadFile("/proc/stat"); err == nil {
		line, _, _ := strings.Cut(string(b), "\n")
		f := strings.Fields(line)
		if len(f) > 8 && f[0] == "cpu" {
			var total float64
			for i, x := range f[1:] {
				n, _ := strconv.ParseFloat(x, 64)
				if i == 3 || i == 4 { // idle, iowait
					continue
				}
				total += n
			}
			s.busy = total / clockTicks
		}
	}
	self := os.Getpid()
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// comm is in parentheses and may contain spaces: the fields follow the last ')'.
		open, end := bytes.IndexByte(b, '('), bytes.LastIndexByte(b, ')')
		if open < 0 || end < open {
			continue
		}
		comm := string(b[open+1 : end])
		f := strings.Fields(string(b[end+1:]))
		if len(f) < 13 {
			continue
		}
		ut, _ := strconv.ParseFloat(f[11], 64)
		st, _ := strconv.ParseFloat(f[12], 64)
		s.procs[pid] = procTime{group: procGroup(pid, self, comm), secs: (ut + st) / clockTicks}
	}
	return s
}

func procGroup(pid, self int, comm string) string {
	switch {
	case pid == self:
		return "consumer"
	case comm == "postgres" || strings.HasPrefix(comm, "postgres"):
		return "postgres"
	case comm == "beam.smp" || comm == "erl_child_setup" || comm == "epmd" || comm == "inet_gethost":
		return "rabbitmq"
	case comm == "mariadbd" || comm == "mysqld":
		return "mariadb"
	case comm == "nats-server":
		return "nats"
	case comm == "redis-server":
		return "redis"
	case comm == "pgbench":
		return "pgbench"
	}
	return "other"
}

// cpuUse is the CPU used between two samples, in cores (CPU seconds per wall second): by the
// whole machine ("machine") and by each process group. A process that started in between counts
// with all its time; one that ended in between is missed (the machine's figure has it).
func cpuUse(a, b cpuSample) map[string]float64 {
	wall := b.at.Sub(a.at).Seconds()
	if wall <= 0 {
		return nil
	}
	out := map[string]float64{"machine": round2((b.busy - a.busy) / wall)}
	groups := map[string]float64{}
	for pid, t := range b.procs {
		d := t.secs
		if before, ok := a.procs[pid]; ok && before.group == t.group && before.secs <= t.secs {
			d -= before.secs
		}
		groups[t.group] += d
	}
	for g, d := range groups {
		out[g] = round2(d / wall)
	}
	return out
}

func round2(f float64) float64 { return float64(int64(f*100+0.5)) / 100 }

// walStats are the write-ahead log counters of a database server, for the whole server: other
// clients add to them. PostgreSQL's come from pg_stat_wal (PostgreSQL 14 and later);
// MariaDB's and MySQL's are InnoDB's fsyncs (of its redo log and of its data files) and the
// bytes written to its redo log, with no full-page images.
type walStats struct {
	ok                bool
	syncs, fpi, bytes int64
}

// serverWAL reads the WAL counters of the server of db; ok is false on SQLite, which has no
// server (its cells count their commits instead: meter.txns).
func serverWAL(ctx context.Context, db *sqldb.DB) walStats {
	var w walStats
	switch db.Dialect {
	case sqldb.Postgres:
		if err := db.QueryRowxContext(ctx, `SELECT wal_sync, wal_fpi, wal_bytes::bigint FROM pg_stat_wal`).Scan(&w.syncs, &w.fpi, &w.bytes); err != nil {
			return walStats{}
		}
	case sqldb.MySQL:
		rows, err := db.QueryxContext(ctx, `SHOW GLOBAL STATUS WHERE Variable_name IN ('Innodb_data_fsyncs', 'Innodb_os_log_written')`)
		if err != nil {
			return walStats{}
		}
		defer rows.Close()
		found := 0
		for rows.Next() {
			var name string
			var value int64
			if err := rows.Scan(&name, &value); err != nil {
				return walStats{}
			}
			switch name {
			case "Innodb_data_fsyncs":
				w.syncs, found = value, found+1
			case "Innodb_os_log_written":
				w.bytes, found = value, found+1
			}
		}
		if rows.Err() != nil || found != 2 {
			return walStats{}
		}
	default:
		return walStats{}
	}
	w.ok = true
	return w
}

// setWAL records the WAL syncs, full-page images and bytes per message between a and b.
func (e *Entry) setWAL(a, b walStats, msgs int) {
	if !a.ok || !b.ok || msgs <= 0 || b.syncs < a.syncs {
		return
	}
	e.WALSyncsPerMsg = perMsg(b.syncs-a.syncs, msgs, 1000)
	e.WALFPIPerMsg = perMsg(b.fpi-a.fpi, msgs, 1000)
	e.WALBytesPerMsg = perMsg(b.bytes-a.bytes, msgs, 1)
}

// perMsg returns d per message of msgs, truncated to 1/scale; 0 without messages. It divides
// in integers, so an exact quotient such as 226/200 stays 1.13 rather than 1.1299.
func perMsg(d int64, msgs int, scale int64) float64 {
	if msgs <= 0 {
		return 0
	}
	return float64(d*scale/int64(msgs)) / float64(scale)
}

// readRSS returns VmRSS and VmHWM of process pid, in KiB.
func readRSS(pid int) (rss, hwm int64, err error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		var v int64
		switch {
		case strings.HasPrefix(line, "VmRSS:"):
			_, _ = fmt.Sscanf(strings.TrimPrefix(line, "VmRSS:"), "%d", &v)
			rss = v
		case strings.HasPrefix(line, "VmHWM:"):
			_, _ = fmt.Sscanf(strings.TrimPrefix(line, "VmHWM:"), "%d", &v)
			hwm = v
		}
	}
	return rss, hwm, sc.Err()
}

// resetPeakRSS returns the memory the Go runtime holds free to the system, resets the peak RSS
// of this process (VmHWM) to its RSS now, and returns that RSS in MiB; 0 when it cannot.
func resetPeakRSS() float64 {
	debug.FreeOSMemory()
	if err := os.WriteFile("/proc/self/clear_refs", []byte("5"), 0); err != nil {
		return 0
	}
	rss, _, err := readRSS(os.Getpid())
	if err != nil {
		return 0
	}
	return round2(float64(rss) / 1024)
}

// peakRSS returns this process's peak RSS since resetPeakRSS, in MiB.
func peakRSS() float64 {
	_, hwm, err := readRSS(os.Getpid())
	if err != nil {
		return 0
	}
	return round2(float64(hwm) / 1024)
}

// cpuPerMsg converts the CPU use of a measured window (cores) into microseconds per message.
func cpuPerMsg(use map[string]float64, seconds float64, msgs int) map[string]float64 {
	if msgs <= 0 || use == nil {
		return nil
	}
	out := map[string]float64{}
	for g, cores := range use {
		if g == "machine" || cores < 0.01 {
			continue
		}
		out[g] = float64(int(cores * seconds / float64(msgs) * 1e6))
	}
	return out
}
