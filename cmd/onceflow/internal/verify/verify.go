// Package verify measures what each quality of service does to message effects under injected
// faults: it publishes messages with unique ids, runs competing consumer processes that apply
// one effect per message to the database, kills them with SIGKILL at random moments and at each
// crash point, cuts their database and broker connections through a loopback TCP proxy, and
// then counts the effects per message id: lost = no effect, duplicated = more than one.
//
// Among the good messages it publishes a few that cannot succeed (poison messages: a data
// error, a panic every time, a malformed payload, an id longer than 255 bytes, one that kills
// its consumer process every time), and counts their dead letters: each must be dead-lettered
// exactly once, while the good ones stay exactly once.
//
// It reproduces the classic delivery-guarantee table (docs/background.md) by measurement. The onceflow command's
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
	// Modes are the modes to measure. Defaults to all five: BestEffort, AtLeastOnce,
	// ExactlyOnce, ExactlyOnceInOrder and ExactlyOnceBatch.
	Modes []Mode
	// GroupCommit runs the exactly-once modes with group commit.
	GroupCommit bool
	// Keys is the number of ordering keys in ExactlyOnceInOrder mode: message i has key
	// i mod Keys and the next sequence of that key. Defaults to 100.
	Keys int
	// Poison are the kinds of poison message published among the good ones of every mode but
	// BestEffort (which has no dead-letter topic), one message each. Defaults to
	// PoisonKinds; NoPoison publishes none.
	Poison []PoisonKind
	// MaxDeliveries is the consumers' delivery limit (onceflow.Handler.DeadLetter's).
	// Defaults to 5: every consumer death (a kill, a crash point, the crash-loop message) and
	// every connection cut counts a delivery of the messages in flight, so a limit as low as 3
	// would dead-letter good messages that three faults happened to meet.
	MaxDeliveries int
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

// Mode is one row of the table: a quality of service, for ExactlyOnce whether its handler
// processes its messages with a batch processor (onceflow.Handler.BatchProcessor, which implies
// group commit), and how it detects duplicates.
type Mode struct {
	QoS   onceflow.QoS
	Batch bool
	// Dedup is how an exactly-once mode detects what it applied already: by id (a dedup row per
	// message, the zero value), by position, or by taking the message off the queue in the
	// handler's transaction.
	Dedup Dedup
}

// Dedup is how an exactly-once mode detects the messages it applied already.
type Dedup string

// The ways of detecting duplicates.
const (
	// DedupByID records each message's id in the handler's dedup table.
	DedupByID Dedup = ""
	// DedupByOffset keeps the last applied offset of each partition in the handler's
	// transaction (middleware.DedupByOffset): Kafka only.
	DedupByOffset Dedup = "ByOffset"
	// DedupAckInTx deletes the queue's lease of the message in the handler's transaction
	// (middleware.DedupAckInTransaction): the PostgreSQL and MySQL queues, in the database
	// of the handler, only.
	DedupAckInTx Dedup = "AckInTx"
)

// The modes.
var (
	BestEffort          = Mode{QoS: onceflow.BestEffort}
	AtLeastOnce         = Mode{QoS: onceflow.AtLeastOnce}
	ExactlyOnce         = Mode{QoS: onceflow.ExactlyOnce}
	ExactlyOnceInOrder  = Mode{QoS: onceflow.ExactlyOnceInOrder}
	ExactlyOnceBatch    = Mode{QoS: onceflow.ExactlyOnce, Batch: true}
	ExactlyOnceByOffset = Mode{QoS: onceflow.ExactlyOnce, Dedup: DedupByOffset}
	ExactlyOnceAckInTx  = Mode{QoS: onceflow.ExactlyOnce, Dedup: DedupAckInTx}
)

// Modes lists the modes every broker has, in the order of the table: the default.
var Modes = []Mode{BestEffort, AtLeastOnce, ExactlyOnce, ExactlyOnceInOrder, ExactlyOnceBatch}

// BrokerModes lists the modes that only some brokers have: ExactlyOnceByOffset (Kafka) and
// ExactlyOnceAckInTx (the PostgreSQL and MySQL queues in the handler's database).
var BrokerModes = []Mode{ExactlyOnceByOffset, ExactlyOnceAckInTx}

// String returns the mode's name: the quality of service's, with "Batch" after it for a batch
// processor, then the way it detects duplicates when that is not by id.
func (m Mode) String() string {
	s := m.QoS.String()
	if m.Batch {
		s += "Batch"
	}
	return s + string(m.Dedup)
}

// exactlyOnce reports whether the mode detects duplicates: its verdict is exactly once.
func (m Mode) exactlyOnce() bool { return m.QoS >= onceflow.ExactlyOnce }

// recordsIDs reports whether the mode records message ids: a message it cannot record (an id
// too long) is poison, and a second publish of an id is a duplicate it drops.
func (m Mode) recordsIDs() bool { return m.exactlyOnce() && m.Dedup == DedupByID }

// ParseMode returns the mode named s, ignoring case and the characters '-' and '_'
// ("exactly-once-batch" and "ExactlyOnceBatch" both work).
func ParseMode(s string) (Mode, error) {
	norm := strings.ToLower(strings.NewReplacer("-", "", "_", "").Replace(s))
	for _, m := range append(append([]Mode(nil), Modes...), BrokerModes...) {
		if strings.ToLower(m.String()) == norm {
			return m, nil
		}
	}
	return Mode{}, fmt.Errorf("unknown mode %q (want BestEffort, AtLeastOnce, ExactlyOnce, ExactlyOnceInOrder, ExactlyOnceBatch, ExactlyOnceByOffset or ExactlyOnceAckInTx)", s)
}

// PoisonKind is a kind of message that cannot succeed.
type PoisonKind string

// The poison kinds.
const (
	// PoisonDataError: its processor's INSERT violates a NOT NULL constraint (the message names
	// no run).
	PoisonDataError PoisonKind = "data-error"
	// PoisonPanic: its processor panics every time.
	PoisonPanic PoisonKind = "panic"
	// PoisonMalformed: its payload is not JSON.
	PoisonMalformed PoisonKind = "malformed-payload"
	// PoisonLongID: its id is 300 bytes, more than the dedup table holds. Published in the
	// modes that record ids, where the broker's publisher carries it.
	PoisonLongID PoisonKind = "long-id"
	// PoisonCrashLoop: its processor kills the consumer process (SIGKILL) every time.
	PoisonCrashLoop PoisonKind = "crash-loop"
)

// PoisonKinds lists every poison kind.
var PoisonKinds = []PoisonKind{PoisonDataError, PoisonPanic, PoisonMalformed, PoisonLongID, PoisonCrashLoop}

// NoPoison, as Config.Poison, publishes no poison message.
var NoPoison = []PoisonKind{}

// ParsePoisonKind returns the poison kind named s.
func ParsePoisonKind(s string) (PoisonKind, error) {
	for _, k := range PoisonKinds {
		if string(k) == s {
			return k, nil
		}
	}
	return "", fmt.Errorf("unknown poison kind %q (want data-error, panic, malformed-payload, long-id or crash-loop)", s)
}

// checkBroker reports why m cannot run on the configured broker and database, if it cannot.
func (c Config) checkBroker(m Mode) error {
	scheme := func(u string) string { s, _, _ := strings.Cut(u, "://"); return s }
	switch m.Dedup {
	case DedupByOffset:
		if scheme(c.BrokerURL) != "kafka" {
			return fmt.Errorf("Modes: %s needs a broker with ordered partitions (kafka://), not %q", m, scheme(c.BrokerURL))
		}
	case DedupAckInTx:
		if s := scheme(c.BrokerURL); (s != "postgres" && s != "mysql") || c.BrokerURL != c.DBURL {
			return fmt.Errorf("Modes: %s needs the PostgreSQL or MySQL queue in the handler's database (the same URL for the broker and the database)", m)
		}
	}
	if m.Dedup != DedupByID && c.Duplicates > 0 {
		return fmt.Errorf("Duplicates: %s applies a second publish of an id again (it detects redeliveries, not republished ids); run it with no duplicates", m)
	}
	return nil
}

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
	case c.MaxDeliveries < 0:
		return fmt.Errorf("MaxDeliveries: %d is negative", c.MaxDeliveries)
	}
	for _, m := range c.Modes {
		if !m.QoS.Valid() || ((m.Batch || m.Dedup != DedupByID) && m.QoS != onceflow.ExactlyOnce) {
			return fmt.Errorf("Modes: %s is not a mode", m)
		}
		if err := c.checkBroker(m); err != nil {
			return err
		}
	}
	for _, k := range c.Poison {
		if _, err := ParsePoisonKind(string(k)); err != nil {
			return fmt.Errorf("Poison: %w", err)
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
		c.Modes = Modes
	}
	if c.Poison == nil {
		c.Poison = PoisonKinds
	}
	if c.MaxDeliveries == 0 {
		c.MaxDeliveries = 5
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
	OrderViolations *int `json:"order_violations,omitempty"`
	// Poison is what became of the mode's poison messages; nil when it published none.
	Poison     *PoisonResult `json:"poison,omitempty"`
	MsgsPerSec float64       `json:"msgs_per_s"`
	Expected   string        `json:"expected"`
	Verdict    string        `json:"verdict"`
	OK         bool          `json:"ok"`
}

// PoisonResult is what became of the poison messages of a mode.
type PoisonResult struct {
	// Published are the poison messages published.
	Published int `json:"published"`
	// DeadLettered are those that reached the dead-letter topic, once or more.
	DeadLettered int `json:"dead_lettered"`
	// Twice are those that reached it more than once.
	Twice int `json:"dead_lettered_twice"`
	// Kinds says, for each kind published, how many dead letters it had.
	Kinds map[PoisonKind]int `json:"kinds"`
	// Reasons are the dead letters' reasons, by kind (the first one's).
	Reasons map[PoisonKind]string `json:"reasons"`
	// Kills are the consumer processes that the crash-loop message killed.
	Kills int `json:"kills"`
	// GoodDeadLettered are good messages that reached the dead-letter topic (they count as
	// lost too: their effect is missing).
	GoodDeadLettered int `json:"good_dead_lettered"`
	// Left are the kinds left out, and why.
	Left map[PoisonKind]string `json:"left_out,omitempty"`
}

// held reports whether every poison message was dead-lettered exactly once, and no good one.
func (p *PoisonResult) held() bool {
	return p == nil || (p.DeadLettered == p.Published && p.Twice == 0 && p.GoodDeadLettered == 0)
}

// Report is the measurement of a run.
type Report struct {
	Broker   string   `json:"broker"`
	Database string   `json:"database"`
	Seed     uint64   `json:"seed"`
	Modes    []Result `json:"modes"`
}

// ExactlyOnceHeld reports whether every exactly-once mode of the run lost and duplicated
// nothing, and dead-lettered each of its poison messages exactly once.
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

// migrate creates the effects, dedup and delivery-count tables.
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
	// The consumers skip migrations: without this table they could not count the deliveries
	// of a broker that counts none, and the delivery limit would not apply there.
	counter, err := dedup.NewCounter(db, dedup.CounterConfig{})
	if err != nil {
		return err
	}
	if err := counter.Migrate(ctx); err != nil {
		return err
	}
	// And the positions of the ExactlyOnceByOffset mode.
	positions, err := dedup.NewPositions(db, dedup.PositionsConfig{})
	if err != nil {
		return err
	}
	if err := positions.Migrate(ctx); err != nil {
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
// batches spread over several goroutines, with the poison messages among them (poison[i] goes
// with the batch of message i*n/len(poison)).
// In ExactlyOnceInOrder mode (keys > 0) message i carries key i mod keys and sequence
// i/keys + 1; a duplicate carries the same.
func publish(pub message.Publisher, topic, runID string, n, duplicates, keys int, poison []*message.Message, rng *rand.Rand) error {
	// A position of ids below 0 stands for poison[-1-position].
	ids := make([]int, 0, n+duplicates+len(poison))
	for i := range n {
		for p := range poison {
			if i == p*n/len(poison) {
				ids = append(ids, -1-p)
			}
		}
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
					if i < 0 {
						msgs[j] = poison[-1-i]
						continue
					}
					msgs[j] = message.NewMessage(messageID(runID, i), goodPayload(runID, i))
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

// goodPayload is the payload of message i: the run it belongs to, whose effects table the
// consumer writes it in, and its number.
func goodPayload(runID string, i int) []byte {
	return []byte(fmt.Sprintf(`{"run":%q,"n":%d}`, runID, i))
}

func orderKey(i, keys int) string { return fmt.Sprintf("key-%04d", i%keys) }

// wantSequences is what ExactlyOnceInOrder must apply: for each key, sequences 1..count.
func wantSequences(n, keys int) map[string]uint64 {
	want := make(map[string]uint64, keys)
	for i := range n {
		want[orderKey(i, keys)]++
	}
	return want
}
