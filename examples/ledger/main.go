// Ledger applies account postings in the order they were booked, exactly once, although the
// transport delivers them shuffled and partly twice: the ExactlyOnceInOrder quality of service
// on the embedded default (a durable SQLite queue as the broker, a separate SQLite file as the
// application database).
//
// A teller books postings (deposits and withdrawals) for a few accounts. Each booking is a
// transaction of the application database that numbers the posting within its account
// (ordering.Sequencer) and writes it to the transactional outbox. A relay sends the outbox
// through a scrambling transport, which stands in for what redeliveries, nacks and competing
// consumers do to a stream: it delivers the postings in random order, a fifth of them twice.
// The "ledger" handler applies each posting to its account; a withdrawal that would overdraw
// the account is declined, so the order matters: the same postings in another order decline
// other withdrawals and end with other balances.
//
// At the end it checks every account: its entries were applied in sequence order (1, 2, 3,
// ...), each once, the running balance of each entry follows from the one before, and the
// final balance and the declined withdrawals are those of booking order.
//
//	go run ./examples/ledger             # files in a new temporary directory
//	go run ./examples/ledger -dir data   # files in ./data, kept
//	go run ./examples/ledger -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable'
//	go run ./examples/ledger -db 'mysql://root@127.0.0.1:3306/test'
//
// With -db the tables are in a schema (PostgreSQL) or database (MariaDB) of the run's own,
// dropped at exit; the queue stays an SQLite file.
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/examples/internal/scratch"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/ordering"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/mysql"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

const (
	topic         = "postings"
	consumerGroup = "ledger"
)

// Posting is the message payload: an amount booked to an account, in cents.
type Posting struct {
	Account string `json:"account"`
	Amount  int64  `json:"amount"`
	Ref     string `json:"ref"`
}

// Account is the end state of one account, and what its entries show.
type Account struct {
	Name     string
	Balance  int64 // final balance
	Entries  int   // postings applied (declined ones included)
	Declined int   // withdrawals declined for lack of funds
	InOrder  bool  // entries applied in sequence order 1..n, once each, running balance consistent
	Expected int64 // the balance booking order gives
}

// Summary is what a run measured.
type Summary struct {
	Postings   int // postings booked
	Deliveries int // messages the transport delivered, copies included
	MaxParked  int // most postings parked at once, waiting for an earlier one
	// Unordered is how many accounts would end with another balance had their postings been
	// applied in the order the transport delivered them.
	Unordered int
	Accounts  []Account
}

func main() {
	dir := flag.String("dir", "", "directory for queue.db and app.db (default: a new temporary directory)")
	dbURL := flag.String("db", "", "database URL: postgres://..., mysql://... (default: app.db beside the queue)")
	accounts := flag.Int("accounts", 8, "accounts")
	per := flag.Int("postings", 50, "postings per account")
	seed := flag.Uint64("seed", 7, "seed of the postings and of the transport's shuffle")
	flag.Parse()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	var s Summary
	err := scratch.Run(*dir, *dbURL, func(ctx context.Context, runDir, runURL string) (err error) {
		s, err = run(ctx, runDir, runURL, *accounts, *per, *seed, logger)
		return err
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "ledger:", err)
		os.Exit(1)
	}
	report(os.Stdout, *dir, s)
	if !s.OK() {
		os.Exit(1)
	}
}

// OK reports whether every account was applied in order and ended as booking order says.
func (s Summary) OK() bool {
	for _, a := range s.Accounts {
		if !a.InOrder || a.Balance != a.Expected {
			return false
		}
	}
	return len(s.Accounts) > 0
}

func report(w io.Writer, dir string, s Summary) {
	if dir == "" {
		fmt.Fprintln(w, "queue in a temporary directory, removed at exit (-dir DIR keeps it)")
	} else {
		fmt.Fprintf(w, "queue in %s\n", dir)
	}
	fmt.Fprintf(w, "booked %d postings; the transport delivered %d messages, shuffled; up to %d waited parked for an earlier posting\n",
		s.Postings, s.Deliveries, s.MaxParked)
	fmt.Fprintf(w, "applied in delivery order instead, %d of %d accounts would end with another balance\n", s.Unordered, len(s.Accounts))
	fmt.Fprintf(w, "%-8s %10s %10s %8s %9s  %s\n", "ACCOUNT", "BALANCE", "EXPECTED", "POSTINGS", "DECLINED", "ENTRIES")
	for _, a := range s.Accounts {
		order := "in sequence order, each once"
		if !a.InOrder {
			order = "OUT OF ORDER"
		}
		fmt.Fprintf(w, "%-8s %10s %10s %8d %9d  %s\n", a.Name, cents(a.Balance), cents(a.Expected), a.Entries, a.Declined, order)
	}
	if s.OK() {
		fmt.Fprintln(w, "every account: postings applied exactly once, in booking order")
	} else {
		fmt.Fprintln(w, "FAIL: some account differs from booking order")
	}
}

func cents(c int64) string { return fmt.Sprintf("%d.%02d", c/100, c%100) }

// book returns the postings of each account in booking order: deposits, and withdrawals that
// may exceed the balance.
func book(accounts, per int, rng *rand.Rand) map[string][]Posting {
	out := map[string][]Posting{}
	for a := range accounts {
		name := fmt.Sprintf("acct-%02d", a+1)
		for i := range per {
			amount := int64(rng.IntN(10000) + 1)
			if rng.IntN(2) == 0 {
				amount = -amount
			}
			out[name] = append(out[name], Posting{Account: name, Amount: amount, Ref: fmt.Sprintf("%s/%03d", name, i+1)})
		}
	}
	return out
}

// replay applies postings in booking order, as the ledger must: the expected final balance
// and number of declined withdrawals.
func replay(ps []Posting) (balance int64, declined int) {
	for _, p := range ps {
		if balance+p.Amount < 0 {
			declined++
			continue
		}
		balance += p.Amount
	}
	return balance, declined
}

// apply is the ledger's processor: it applies one posting to its account, or declines a
// withdrawal that would overdraw it, and records the entry with its sequence number and the
// balance after it. The in-order stage holds the lock of the account's ordering key in the
// transaction, so the postings of one account never run at once.
func apply(ctx context.Context, md *messagedata.MessageData, p Posting) error {
	tx, _ := processor.TxFromContext(ctx)
	var balance int64
	err := tx.GetContext(ctx, &balance, tx.Rebind(`SELECT balance FROM accounts WHERE account = ?`), p.Account)
	opened := errors.Is(err, sql.ErrNoRows)
	if err != nil && !opened {
		return err
	}
	status := "applied"
	if balance+p.Amount < 0 {
		status = "declined"
	} else {
		balance += p.Amount
	}
	write := `UPDATE accounts SET balance = ? WHERE account = ?`
	if opened {
		write = `INSERT INTO accounts (balance, account) VALUES (?, ?)`
	}
	if _, err := tx.ExecContext(ctx, tx.Rebind(write), balance, p.Account); err != nil {
		return err
	}
	_, err = tx.ExecContext(ctx, tx.Rebind(`INSERT INTO entries (account, seq, ref, amount, status, balance_after) VALUES (?, ?, ?, ?, ?, ?)`),
		p.Account, int64(md.Sequence), p.Ref, p.Amount, status, balance)
	return err
}

// scrambler stands in for the transport of the issue: it takes what the relay sends and
// delivers it later, shuffled, a fifth of it twice. (A real transport returns from Publish only
// once the broker has the message; this one buffers, which is good enough for a demonstration
// of what reordering does.)
type scrambler struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (s *scrambler) Publish(_ string, msgs ...*message.Message) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range msgs {
		s.msgs = append(s.msgs, m.Copy())
	}
	return nil
}

func (s *scrambler) Close() error { return nil }

// deliver publishes everything held to pub, shuffled, a fifth twice, and returns what it
// published, in order.
func (s *scrambler) deliver(pub message.Publisher, rng *rand.Rand) ([]*message.Message, error) {
	s.mu.Lock()
	out := append([]*message.Message(nil), s.msgs...)
	s.msgs = nil
	s.mu.Unlock()
	for _, m := range out[:len(out)/5] {
		out = append(out, m.Copy())
	}
	rng.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out, pub.Publish(topic, out...)
}

// run publishes to a queue in dir and keeps the ledger in the database of dbURL.
func run(ctx context.Context, dir, dbURL string, accounts, per int, seed uint64, logger *slog.Logger) (Summary, error) {
	var s Summary
	rng := rand.New(rand.NewPCG(seed, seed))
	queue, err := sqlitequeue.Open(ctx, "sqlite://"+filepath.Join(dir, "queue.db"), sqlitequeue.Config{ConsumerGroup: consumerGroup})
	if err != nil {
		return s, err
	}
	defer queue.Close()
	db, err := sqldb.Open(ctx, dbURL)
	if err != nil {
		return s, err
	}
	defer db.Close()
	// The entries are numbered in the order they are applied, which each dialect writes its
	// own way.
	serial := map[sqldb.Dialect]string{
		sqldb.SQLite:   "INTEGER PRIMARY KEY AUTOINCREMENT",
		sqldb.Postgres: "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
		sqldb.MySQL:    "BIGINT AUTO_INCREMENT PRIMARY KEY",
	}[db.Dialect]
	for _, ddl := range []string{
		`CREATE TABLE IF NOT EXISTS accounts (account VARCHAR(64) PRIMARY KEY, balance BIGINT NOT NULL)`,
		`CREATE TABLE IF NOT EXISTS entries (id ` + serial + `, account VARCHAR(64) NOT NULL, seq BIGINT NOT NULL,
			ref VARCHAR(64) NOT NULL, amount BIGINT NOT NULL, status VARCHAR(16) NOT NULL, balance_after BIGINT NOT NULL)`,
	} {
		if _, err := db.ExecContext(ctx, ddl); err != nil {
			return s, err
		}
	}
	ob, err := outbox.New(db, outbox.Config{})
	if err != nil {
		return s, err
	}
	seq, err := ordering.NewSequencer(db, ordering.SequencerConfig{})
	if err != nil {
		return s, err
	}
	for _, migrate := range []func(context.Context) error{ob.Migrate, seq.Migrate} {
		if err := migrate(ctx); err != nil {
			return s, err
		}
	}

	// The teller books every posting in a transaction of its own: the sequence number and the
	// outbox message commit together, or neither does.
	booked := book(accounts, per, rng)
	names := make([]string, 0, len(booked))
	for name := range booked {
		names = append(names, name)
	}
	sort.Strings(names)
	for i := range per {
		for _, name := range names {
			p := booked[name][i]
			msg := message.NewMessage(outbox.DerivedID(p.Ref, "posting"),
				[]byte(fmt.Sprintf(`{"account":%q,"amount":%d,"ref":%q}`, p.Account, p.Amount, p.Ref)))
			if err := inTx(ctx, db, func(tx *sqlx.Tx) error { return seq.PublishTx(ctx, tx, ob, topic, p.Account, msg) }); err != nil {
				return s, fmt.Errorf("book %s: %w", p.Ref, err)
			}
			s.Postings++
		}
	}

	// The relay sends the outbox through the scrambling transport to the queue.
	transport := &scrambler{}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: transport, PollInterval: 10 * time.Millisecond, Logger: logger})
	if err != nil {
		return s, err
	}
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(ctx) }()
	if err := waitFor(ctx, func() (bool, error) {
		st, err := relay.Stats(ctx)
		return st.Backlog == 0, err
	}); err != nil {
		return s, err
	}
	if err := errors.Join(relay.Close(), <-relayDone); err != nil {
		return s, err
	}
	delivered, err := transport.deliver(queue.Publisher(), rng)
	if err != nil {
		return s, err
	}
	s.Deliveries = len(delivered)
	s.Unordered = unordered(booked, delivered)

	// The ledger handler applies them, in order per account.
	router, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: queue.Publisher(), Logger: logger, PurgeInterval: -1})
	if err != nil {
		return s, err
	}
	sub, err := queue.Subscriber()
	if err != nil {
		return s, err
	}
	// Each posting's transaction also counts the postings parked at that moment, waiting for
	// an earlier one of their account: the most at once shows how far the shuffle ran ahead.
	var maxParked atomic.Int64
	observed := func(ctx context.Context, md *messagedata.MessageData, p Posting) error {
		tx, _ := processor.TxFromContext(ctx)
		var parked int64
		if err := tx.GetContext(ctx, &parked, `SELECT COUNT(*) FROM onceflow_order_parked`); err != nil {
			return err
		}
		for cur := maxParked.Load(); parked > cur && !maxParked.CompareAndSwap(cur, parked); cur = maxParked.Load() {
		}
		return apply(ctx, md, p)
	}
	if err := router.AddHandler(onceflow.Handler{
		Name: "ledger", Topic: topic, Subscriber: sub, DB: db,
		QoS:       onceflow.ExactlyOnceInOrder,
		Processor: processor.JSON(observed),
	}); err != nil {
		return s, err
	}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(runCtx) }()
	select {
	case <-router.Running():
	case err := <-routerDone:
		return s, fmt.Errorf("router: %w", err)
	}
	err = waitFor(ctx, func() (bool, error) {
		var parked int
		if err := db.GetContext(ctx, &parked, `SELECT COUNT(*) FROM onceflow_order_parked`); err != nil {
			return false, err
		}
		left, err := queue.Backlog(ctx, topic, consumerGroup)
		return left == 0 && parked == 0, err
	})
	s.MaxParked = int(maxParked.Load())
	stop()
	if err := errors.Join(err, <-routerDone); err != nil {
		return s, err
	}

	for _, name := range names {
		a, err := check(ctx, db, name, booked[name])
		if err != nil {
			return s, err
		}
		s.Accounts = append(s.Accounts, a)
	}
	return s, nil
}

// check reads the entries of account in the order they were applied and compares them with
// booking order.
func check(ctx context.Context, db *sqldb.DB, account string, booked []Posting) (Account, error) {
	a := Account{Name: account, InOrder: true}
	a.Expected, _ = replay(booked)
	var entries []struct {
		Seq          int64  `db:"seq"`
		Amount       int64  `db:"amount"`
		Status       string `db:"status"`
		BalanceAfter int64  `db:"balance_after"`
	}
	if err := db.SelectContext(ctx, &entries, db.Rebind(`SELECT seq, amount, status, balance_after FROM entries WHERE account = ? ORDER BY id`), account); err != nil {
		return a, err
	}
	var running int64
	for i, e := range entries {
		if e.Seq != int64(i+1) {
			a.InOrder = false
		}
		switch e.Status {
		case "applied":
			running += e.Amount
		case "declined":
			a.Declined++
		}
		a.Entries++
		if e.BalanceAfter != running || running < 0 {
			a.InOrder = false
		}
	}
	if len(entries) != len(booked) {
		a.InOrder = false
	}
	_, declined := replay(booked)
	if declined != a.Declined {
		a.InOrder = false
	}
	if err := db.GetContext(ctx, &a.Balance, db.Rebind(`SELECT COALESCE((SELECT balance FROM accounts WHERE account = ?), 0)`), account); err != nil {
		return a, err
	}
	return a, nil
}

// unordered counts the accounts whose balance would differ had each posting been applied at
// its first delivery.
func unordered(booked map[string][]Posting, delivered []*message.Message) int {
	byID := map[string]Posting{}
	for _, ps := range booked {
		for _, p := range ps {
			byID[outbox.DerivedID(p.Ref, "posting")] = p
		}
	}
	seen := map[string]bool{}
	arrival := map[string][]Posting{}
	for _, m := range delivered {
		if p, ok := byID[m.UUID]; ok && !seen[m.UUID] {
			seen[m.UUID] = true
			arrival[p.Account] = append(arrival[p.Account], p)
		}
	}
	n := 0
	for name, ps := range booked {
		want, _ := replay(ps)
		if got, _ := replay(arrival[name]); got != want {
			n++
		}
	}
	return n
}

func inTx(ctx context.Context, db *sqldb.DB, fn func(*sqlx.Tx) error) error {
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		return errors.Join(err, tx.Rollback())
	}
	return tx.Commit()
}

// waitFor polls done every 20 ms, for at most 2 minutes.
func waitFor(ctx context.Context, done func() (bool, error)) error {
	deadline := time.After(2 * time.Minute)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		ok, err := done()
		if err != nil || ok {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-deadline:
			return errors.New("not done within 2 minutes")
		case <-tick.C:
		}
	}
}
