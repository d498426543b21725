// Package verify measures what each quality of service does to message effects under injected
// faults: it publishes messages with unique ids, runs competing consumer processes that apply
// one effect per message to the database, kills them with SIGKILL at random moments and at each
// crash point, cuts their database and broker connections through a loopback TCP proxy, and
// then counts the effects per message id: lost = no effect, duplicated = more than one.
//
// It reproduces seed 001's delivery-guarantee table by measurement. The onceflow command's
// verify subcommand is its user interface.
package verify

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	_ "github.com/onceflow/onceflow/broker/all"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/ordercheck"
	"github.com/onceflow/onceflow/ordering"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/mysql"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

// Config configures a verification run. The zero value runs the default on the embedded SQLite
// queue and database.
type Config struct {
	// BrokerURL is the broker to verify. Defaults to an SQLite queue in Dir.
	BrokerURL string
	// DBURL is the application database. Defaults to an SQLite database in Dir.
	DBURL string
	// Dir holds the embedded queue and database, and the consumers' logs. Defaults to a new
	// temporary directory, removed at the end unless KeepDir is set.
	Dir string
	// KeepDir keeps Dir after the run.
	KeepDir bool
	// Messages is the number of distinct messages per mode. Defaults to 10,000.
	Messages int
	// Duplicates is the number of deliberate second publishes of already published ids.
	Duplicates int
	// Consumers is the number of competing consumer processes. Defaults to 3.
	Consumers int
	// Concurrency is the handler concurrency inside each consumer. Defaults to 4.
	Concurrency int
	// Kills is the number of SIGKILLs at random moments per mode; each killed consumer restarts
	// with a crash point armed, so a mode sees about twice as many kills in all. Defaults to 20;
	// None disables them.
	Kills int
	// Cuts is the number of connection cuts per mode, alternating between the database and the
	// broker connections. Only network services can be cut: a run with SQLite for both reports
	// none. Defaults to 5; None disables them.
	Cuts int
	// Modes are the qualities of service to measure. Defaults to all four: BestEffort,
	// AtLeastOnce, ExactlyOnce and ExactlyOnceInOrder.
	Modes []onceflow.QoS
	// GroupCommit runs the exactly-once modes with group commit.
	GroupCommit bool
	// Keys is the number of ordering keys in ExactlyOnceInOrder mode: message i has key
	// i mod Keys and the next sequence of that key. Defaults to 100.
	Keys int
	// Seed makes the fault schedule repeatable. Defaults to a random seed.
	Seed uint64
	// Settle is how long effects must stay unchanged before a mode counts as finished.
	// Defaults to 2 s.
	Settle time.Duration
	// Stall fails a mode when no effect is added for this long while messages are missing.
	// Defaults to 60 s; BestEffort modes finish instead.
	Stall time.Duration
	// Executable is the command that runs one consumer; the consumer's flags are appended.
	// Defaults to this executable with the argument "verify-consumer".
	Executable []string
	// Progress receives a progress line per mode; nil for none.
	Progress io.Writer
	// Logger receives the run's logs. Defaults to discarding them.
	Logger *slog.Logger
}

// None, as Kills or Cuts, asks for no fault of that kind.
const None = -1

// Validate reports the first invalid field.
func (c Config) Validate() error {
	switch {
	case c.Messages < 0:
		return fmt.Errorf("Messages: %d is negative", c.Messages)
	case c.Duplicates < 0 || (c.Messages > 0 && c.Duplicates > c.Messages):
		return fmt.Errorf("Duplicates: %d is not between 0 and Messages", c.Duplicates)
	case c.Consumers < 0, c.Concurrency < 0, c.Keys < 0:
		return errors.New("Consumers, Concurrency and Keys must not be negative")
	case c.Kills < None, c.Cuts < None:
		return errors.New("Kills and Cuts must not be negative (None disables them)")
	}
	for _, m := range c.Modes {
		if !m.Valid() {
			return fmt.Errorf("Modes: %s is not a quality of service", m)
		}
	}
	return nil
}

func (c *Config) setDefaults() {
	if c.Messages == 0 {
		c.Messages = 10000
	}
	if c.Consumers == 0 {
		c.Consumers = 3
	}
	if c.Concurrency == 0 {
		c.Concurrency = 4
	}
	switch c.Kills {
	case 0:
		c.Kills = 20
	case None:
		c.Kills = 0
	}
	switch c.Cuts {
	case 0:
		c.Cuts = 5
	case None:
		c.Cuts = 0
	}
	if len(c.Modes) == 0 {
		c.Modes = []onceflow.QoS{onceflow.BestEffort, onceflow.AtLeastOnce, onceflow.ExactlyOnce, onceflow.ExactlyOnceInOrder}
	}
	if c.Keys == 0 {
		c.Keys = 100
	}
	if c.Seed == 0 {
		c.Seed = rand.Uint64()
	}
	if c.Settle == 0 {
		c.Settle = 2 * time.Second
	}
	if c.Stall == 0 {
		c.Stall = 60 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
}

// Result is the measurement of one mode.
type Result struct {
	Mode        string             `json:"mode"`
	Messages    int                `json:"messages"`
	Duplicates  int                `json:"duplicate_publishes"`
	Kills       int                `json:"kills"`
	CrashPoints map[CrashPoint]int `json:"crash_point_kills"`
	Cuts        int                `json:"connection_cuts"`
	Lost        int                `json:"lost"`
	Duplicated  int                `json:"duplicated"`
	// OrderViolations counts, in ExactlyOnceInOrder mode, the messages applied after a later
	// sequence of their key; nil in the other modes, which promise no order.
	OrderViolations *int    `json:"order_violations,omitempty"`
	MsgsPerSec      float64 `json:"msgs_per_s"`
	Expected        string  `json:"expected"`
	Verdict         string  `json:"verdict"`
	OK              bool    `json:"ok"`
}

// Report is the measurement of a run.
type Report struct {
	Broker   string   `json:"broker"`
	Database string   `json:"database"`
	Seed     uint64   `json:"seed"`
	Modes    []Result `json:"modes"`
}

// ExactlyOnceHeld reports whether every exactly-once mode of the run lost and duplicated
// nothing.
func (r Report) ExactlyOnceHeld() bool {
	for _, m := range r.Modes {
		if strings.HasPrefix(m.Mode, "ExactlyOnce") && !m.OK {
			return false
		}
	}
	return true
}

// Run measures every mode of cfg in turn.
func Run(ctx context.Context, cfg Config) (Report, error) {
	if err := cfg.Validate(); err != nil {
		return Report{}, err
	}
	cfg.setDefaults()
	if cfg.Dir == "" {
		dir, err := os.MkdirTemp("", "onceflow-verify-")
		if err != nil {
			return Report{}, err
		}
		cfg.Dir = dir
		if !cfg.KeepDir {
			defer os.RemoveAll(dir)
		}
	} else if err := os.MkdirAll(cfg.Dir, 0o755); err != nil {
		return Report{}, err
	}
	if cfg.BrokerURL == "" {
		cfg.BrokerURL = "sqlite://" + filepath.Join(cfg.Dir, "queue.db")
	}
	if cfg.DBURL == "" {
		cfg.DBURL = "sqlite://" + filepath.Join(cfg.Dir, "app.db")
	}
	if len(cfg.Executable) == 0 {
		exe, err := os.Executable()
		if err != nil {
			return Report{}, err
		}
		cfg.Executable = []string{exe, "verify-consumer"}
	}

	db, err := sqldb.Open(ctx, cfg.DBURL)
	if err != nil {
		return Report{}, err
	}
	defer db.Close()
	if err := migrate(ctx, db); err != nil {
		return Report{}, err
	}
	b, err := broker.Open(ctx, cfg.BrokerURL, brokerOptions())
	if err != nil {
		return Report{}, err
	}
	defer b.Close()

	report := Report{Broker: b.String(), Database: db.String(), Seed: cfg.Seed}
	rng := rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15))
	for _, mode := range cfg.Modes {
		res, err := runMode(ctx, cfg, db, b, mode, rng)
		if err != nil {
			return report, fmt.Errorf("%s: %w", mode, err)
		}
		report.Modes = append(report.Modes, res)
	}
	return report, nil
}

// migrate creates the effects and dedup tables.
func migrate(ctx context.Context, db *sqldb.DB) error {
	ddl := `CREATE TABLE IF NOT EXISTS ` + effectsTable + ` (
		run_id VARCHAR(32) NOT NULL,
		message_id VARCHAR(64) NOT NULL,
		consumer INTEGER NOT NULL)`
	if _, err := db.ExecContext(ctx, ddl); err != nil {
		return fmt.Errorf("create %s: %w", effectsTable, err)
	}
	// PostgreSQL, MariaDB and SQLite all accept CREATE INDEX IF NOT EXISTS.
	idx := `CREATE INDEX IF NOT EXISTS onceflow_verify_effects_run ON ` + effectsTable + ` (run_id, message_id)`
	if _, err := db.ExecContext(ctx, idx); err != nil {
		return fmt.Errorf("index %s: %w", effectsTable, err)
	}
	store, err := dedup.New(db, dedup.Config{})
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	order, err := ordering.NewStore(db, ordering.StoreConfig{})
	if err != nil {
		return err
	}
	if err := order.Migrate(ctx); err != nil {
		return err
	}
	return ordercheck.Create(ctx, db, appliedTable)
}

func newRunID() string {
	var b [6]byte
	_, _ = crand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// publishers is how many goroutines publish at once: a broker that confirms each message
// (RabbitMQ with publisher confirms) needs several in flight to reach its own rate.
const publishers = 8

// publish sends the mode's messages: every id once, then Duplicates of them a second time, in
// batches spread over several goroutines.
// In ExactlyOnceInOrder mode (keys > 0) message i carries key i mod keys and sequence
// i/keys + 1; a duplicate carries the same.
func publish(pub message.Publisher, topic, runID string, n, duplicates, keys int, rng *rand.Rand) error {
	ids := make([]int, 0, n+duplicates)
	for i := range n {
		ids = append(ids, i)
	}
	ids = append(ids, rng.Perm(n)[:duplicates]...)

	const batch = 100
	work := make(chan []int)
	errs := make(chan error, publishers)
	var wg sync.WaitGroup
	for range publishers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for chunk := range work {
				msgs := make([]*message.Message, len(chunk))
				for j, i := range chunk {
					msgs[j] = message.NewMessage(messageID(runID, i), []byte(fmt.Sprintf(`{"n":%d}`, i)))
					if keys > 0 {
						ordering.SetSequence(msgs[j], orderKey(i, keys), uint64(i/keys+1))
					}
				}
				if err := pub.Publish(topic, msgs...); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	var err error
loop:
	for start := 0; start < len(ids); start += batch {
		select {
		case work <- ids[start:min(start+batch, len(ids))]:
		case err = <-errs:
			break loop
		}
	}
	close(work)
	wg.Wait()
	if err == nil {
		select {
		case err = <-errs:
		default:
		}
	}
	return err
}

func messageID(runID string, i int) string { return fmt.Sprintf("%s-%06d", runID, i) }

func orderKey(i, keys int) string { return fmt.Sprintf("key-%04d", i%keys) }

// wantSequences is what ExactlyOnceInOrder must apply: for each key, sequences 1..count.
func wantSequences(n, keys int) map[string]uint64 {
	want := make(map[string]uint64, keys)
	for i := range n {
		want[orderKey(i, keys)]++
	}
	return want
}
