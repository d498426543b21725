// Package verify measures what each quality of service does to message effects under injected
// faults: for each mode it runs a handler that applies one effect per message to the database
// under package onceflowtest, which publishes messages with unique ids (some twice, among poison
// messages that cannot succeed), runs competing consumer processes, kills them with SIGKILL at
// random moments and at each crash point, injects failures and panics, cuts their database and
// broker connections through a loopback TCP proxy, and counts the effects per message id: lost =
// no effect, duplicated = more than one; each poison message must be dead-lettered exactly once.
//
// It reproduces the classic delivery-guarantee table (docs/background.md) by measurement. The
// onceflow command's verify subcommand is its user interface; its verify-consumer subcommand is
// the consumer process (Consume).
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
	"time"

	"github.com/onceflow/onceflow"
	_ "github.com/onceflow/onceflow/broker/all"
	"github.com/onceflow/onceflow/onceflowtest"
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
	// Executable is the command that runs one consumer process, which calls Consume; the
	// flags of the mode's handler (ConsumerConfig.Args) are appended. Defaults to this
	// executable with the argument "verify-consumer".
	Executable []string
	// Progress receives a progress line per mode; nil for none.
	Progress io.Writer
	// Logger receives the run's logs, and at WARN, for a mode that failed, the account of the
	// messages that went wrong (onceflowtest.Report.Err). Defaults to discarding them.
	Logger *slog.Logger
}

// None, as Kills or Cuts, asks for no fault of that kind.
const None = onceflowtest.None

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
	Mode string `json:"mode"`
	// Topic is the topic the mode published to and consumed, of this run alone
	// (verify_<mode>_<6 hex digits of the run id>), so that runs on one broker, at once or
	// after one that left messages behind, take none of each other's. Its dead letters go to
	// Topic + "_dlq", which stays within the SQL queues' 45 bytes.
	Topic       string                          `json:"topic"`
	Messages    int                             `json:"messages"`
	Duplicates  int                             `json:"duplicate_publishes"`
	Kills       int                             `json:"kills"`
	CrashPoints map[onceflowtest.CrashPoint]int `json:"crash_point_kills"`
	Cuts        int                             `json:"connection_cuts"`
	Lost        int                             `json:"lost"`
	Duplicated  int                             `json:"duplicated"`
	// OrderViolations counts, in ExactlyOnceInOrder mode, the messages applied after a later
	// sequence of their key; nil in the other modes, which promise no order.
	OrderViolations *int `json:"order_violations,omitempty"`
	// Poison is what became of the mode's poison messages (by kind); nil when it published
	// none.
	Poison     *PoisonResult `json:"poison,omitempty"`
	MsgsPerSec float64       `json:"msgs_per_s"`
	Expected   string        `json:"expected"`
	Verdict    string        `json:"verdict"`
	OK         bool          `json:"ok"`
}

// PoisonResult is what became of the poison messages of a mode, by kind.
type PoisonResult = onceflowtest.PoisonResult

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

	report := Report{Seed: cfg.Seed}
	rng := rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15))
	for _, mode := range cfg.Modes {
		res, run, err := runMode(ctx, cfg, mode, rng.Uint64())
		if err != nil {
			return report, fmt.Errorf("%s: %w", mode, err)
		}
		report.Broker, report.Database = run.Broker, run.Database
		report.Modes = append(report.Modes, res)
	}
	return report, nil
}

// runMode measures one mode, with the fault schedule of seed.
func runMode(ctx context.Context, cfg Config, mode Mode, seed uint64) (Result, onceflowtest.Report, error) {
	runID := newRunID()
	name := strings.ToLower(mode.String())
	// A batch processor implies group commit.
	groupCommit := mode.Batch || (cfg.GroupCommit && mode.exactlyOnce())
	if groupCommit && !mode.Batch {
		name += "_gc"
	}
	consumer := ConsumerConfig{
		Topic: "verify_" + name + "_" + runID[:6], Name: "verify_" + name + "_" + runID, RunID: runID,
		Mode: mode.QoS, GroupCommit: groupCommit, Batch: mode.Batch, Dedup: mode.Dedup,
		Concurrency: cfg.Concurrency, MaxDeliveries: cfg.MaxDeliveries,
	}
	duplicates := cfg.Duplicates
	if duplicates == 0 {
		duplicates = None
	}
	run, err := onceflowtest.Run(ctx, onceflowtest.Config{
		Handler: consumer.Handler,
		Message: func(i int) onceflowtest.Message {
			return onceflowtest.Message{ID: fmt.Sprintf("%s-%06d", runID, i), Payload: goodPayload(runID, i)}
		},
		Effects: `SELECT message_id, COUNT(*) FROM ` + effectsTable + ` WHERE run_id = '` + runID + `' GROUP BY message_id`,
		Setup:   migrate,

		Messages: cfg.Messages, BrokerURL: cfg.BrokerURL, DBURL: cfg.DBURL, Dir: cfg.Dir,
		Consumers: cfg.Consumers, Kills: cfg.Kills, Cuts: cfg.Cuts, Duplicates: duplicates,
		Poison: poisonOf(cfg.Poison, runID), Keys: cfg.Keys, Seed: seed, Settle: cfg.Settle, Stall: cfg.Stall,
		Name: mode.String(), Command: append(append([]string(nil), cfg.Executable...), consumer.Args()...),
		Progress: cfg.Progress, Logger: cfg.Logger,
	})
	if err != nil {
		return Result{}, run, err
	}
	res := Result{
		Mode: mode.String(), Topic: consumer.Topic, Messages: run.Messages, Duplicates: run.Duplicates, Kills: run.Kills, CrashPoints: run.CrashPoints,
		Cuts: run.Cuts, Lost: run.Lost, Duplicated: run.Duplicated, OrderViolations: run.OutOfOrder, Poison: run.Poison,
		MsgsPerSec: run.MsgsPerSec,
	}
	violations := 0
	if run.OutOfOrder != nil {
		violations = *run.OutOfOrder
	}
	res.Expected, _ = expectation(mode)
	res.Verdict, res.OK = verdict(mode.QoS, run.Lost, run.Duplicated, violations)
	if !run.Poison.Held() && mode.QoS != BestEffort.QoS {
		res.Verdict += fmt.Sprintf("; FAIL: %s", run.Poison)
		res.OK = false
	}
	if !res.OK {
		cfg.Logger.Warn("the mode failed", "mode", mode.String(), "error", run.Err())
	}
	return res, run, nil
}

// poisonOf returns the poison messages of the kinds, for the run runID.
func poisonOf(kinds []PoisonKind, runID string) []onceflowtest.Poison {
	out := []onceflowtest.Poison{}
	for _, k := range kinds {
		switch k {
		case PoisonDataError:
			// It names no run: the effect's INSERT violates NOT NULL.
			out = append(out, onceflowtest.Poison{Name: string(k), Message: onceflowtest.Message{Payload: []byte(`{"run":null,"n":-1}`)}})
		case PoisonMalformed:
			out = append(out, onceflowtest.Poison{Name: string(k), Message: onceflowtest.Message{Payload: []byte(`{"run":"` + runID + `","n":`)}})
		case PoisonPanic:
			out = append(out, onceflowtest.PoisonPanic)
		case PoisonLongID:
			out = append(out, onceflowtest.PoisonLongID)
		case PoisonCrashLoop:
			out = append(out, onceflowtest.PoisonCrashLoop)
		}
	}
	return out
}

// expectation returns the delivery-guarantee table's entry for a persistent broker in mode's
// column (docs/background.md).
func expectation(m Mode) (string, bool) {
	switch {
	case m.Batch:
		return "exactly once (batch processor)", true
	case m.Dedup == DedupByOffset:
		return "exactly once (offsets in the transaction)", true
	case m.Dedup == DedupAckInTx:
		return "exactly once (ack in the transaction)", true
	}
	switch m.QoS {
	case onceflow.BestEffort:
		return "maybe (lost on consumer crash)", false
	case onceflow.AtLeastOnce:
		return "at least once (duplicates)", false
	case onceflow.ExactlyOnceInOrder:
		return "exactly once, in order per key", true
	}
	return "exactly once", true
}

func verdict(mode onceflow.QoS, lost, duplicated, orderViolations int) (string, bool) {
	switch mode {
	case onceflow.BestEffort:
		if lost > 0 {
			return fmt.Sprintf("as promised: %d lost", lost), true
		}
		return "no loss this run: the faults missed the window between ack and commit", true
	case onceflow.AtLeastOnce:
		if lost > 0 {
			return fmt.Sprintf("FAIL: %d lost", lost), false
		}
		if duplicated > 0 {
			return fmt.Sprintf("as promised: nothing lost, %d duplicated", duplicated), true
		}
		return "nothing lost; no duplicate this run", true
	}
	if mode == onceflow.ExactlyOnceInOrder {
		if lost == 0 && duplicated == 0 && orderViolations == 0 {
			return "PASS: exactly once, in order", true
		}
		return fmt.Sprintf("FAIL: %d lost, %d duplicated, %d out of order", lost, duplicated, orderViolations), false
	}
	if lost == 0 && duplicated == 0 {
		return "PASS: exactly once", true
	}
	return fmt.Sprintf("FAIL: %d lost, %d duplicated", lost, duplicated), false
}

func newRunID() string {
	var b [6]byte
	_, _ = crand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// goodPayload is the payload of message i: the run it belongs to, whose effects table the
// consumer writes it in, and its number.
func goodPayload(runID string, i int) []byte {
	return []byte(fmt.Sprintf(`{"run":%q,"n":%d}`, runID, i))
}
