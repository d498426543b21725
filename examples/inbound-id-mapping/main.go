// Inbound-id-mapping is an inbound adapter in the style of SAP XI (docs/background.md): messages
// from an external system carry the external system's ids, and each becomes exactly one
// internal message with an internal, time-ordered id.
//
// For each external message, in one unit of work (one database transaction):
//
//  1. the external id is looked up in the id mapping first (check-first, optimistic: a
//     redelivered message costs one read and is acknowledged without being processed);
//  2. an internal id is minted, time-ordered (a ULID, processor.InternalID);
//  3. the module chain runs (here: the processor, which must not commit);
//  4. the external-to-internal mapping is stored with an expiry (24 h, as in the adapter's manual);
//  5. the forwarded message, carrying the internal id, is put on the internal queue through
//     the transactional outbox;
//
// then the transaction commits, and only then the external message is acknowledged; on any
// failure both roll back. A relay moves the outbox to the internal topic, where an internal
// ExactlyOnce handler consumes the forwarded messages.
//
//	go run ./examples/inbound-id-mapping            # embedded SQLite queue and database
//	go run ./examples/inbound-id-mapping -broker amqp://guest:guest@127.0.0.1:5672/ -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable'
//	go run ./examples/inbound-id-mapping -broker amqp://guest:guest@127.0.0.1:5672/ -db 'mysql://root@127.0.0.1:3306/test'
//
// With -db the tables are in a schema (PostgreSQL) or database (MariaDB) of the run's own,
// dropped at exit; the topics are the run's own too.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	_ "github.com/onceflow/onceflow/broker/all"
	"github.com/onceflow/onceflow/examples/internal/scratch"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/mysql"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

// mappingExpiry is how long an external id stays mapped: the adapter manual's 24 hours. A redelivery
// within that time is recognised; the broker must not redeliver later than that.
const mappingExpiry = 24 * time.Hour

// Options configure a run.
type Options struct {
	BrokerURL string
	DBURL     string
	Messages  int // distinct external messages
	Resent    int // of them, how many the external system sends a second time
}

// Summary is what a run measured.
type Summary struct {
	Received      int      // external deliveries, resends included
	Mappings      int      // rows in the id mapping
	Forwarded     int      // internal messages applied by the internal handler
	InternalIDs   []string // internal ids in the order their external messages were mapped
	TimeOrdered   bool     // whether the internal ids sort in mapping order
	OneToOne      bool     // whether every external id maps to exactly one internal message
	ExpiresInHour float64  // hours from mapping to expiry, as stored
}

func main() {
	var o Options
	flag.StringVar(&o.BrokerURL, "broker", "", "broker URL: amqp://..., nats://... (default: an SQLite queue in a temporary directory)")
	flag.StringVar(&o.DBURL, "db", "", "database URL: postgres://..., mysql://... (default: SQLite in a temporary directory)")
	flag.IntVar(&o.Messages, "messages", 100, "distinct external messages")
	flag.IntVar(&o.Resent, "resent", 30, "external messages sent a second time")
	flag.Parse()
	var s Summary
	err := scratch.Run("", o.DBURL, func(ctx context.Context, dir, runURL string) (err error) {
		o.DBURL = runURL
		if o.BrokerURL == "" {
			o.BrokerURL = "sqlite://" + filepath.Join(dir, "queue.db")
		}
		s, err = run(ctx, o, slog.New(slog.NewTextHandler(io.Discard, nil)))
		return err
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "inbound-id-mapping:", err)
		os.Exit(1)
	}
	fmt.Printf("received %d external deliveries (%d distinct, %d sent twice)\n", s.Received, o.Messages, o.Resent)
	fmt.Printf("id mappings: %d, expiring %.0f h after they were stored\n", s.Mappings, s.ExpiresInHour)
	fmt.Printf("internal messages forwarded and applied: %d (one per external message: %v)\n", s.Forwarded, s.OneToOne)
	fmt.Printf("internal ids time-ordered: %v (first %s, last %s)\n", s.TimeOrdered, s.InternalIDs[0], s.InternalIDs[len(s.InternalIDs)-1])
}

func run(ctx context.Context, o Options, logger *slog.Logger) (s Summary, err error) {
	// Topics of the run's own: a broker keeps what an earlier run left on its topics.
	runID := newID()
	externalTopic, internalTopic := "inbound_"+runID, "internal_orders_"+runID
	db, err := sqldb.Open(ctx, o.DBURL)
	if err != nil {
		return Summary{}, err
	}
	defer db.Close()
	b, err := broker.Open(ctx, o.BrokerURL, broker.Options{ConsumerGroup: "inbound"})
	if err != nil {
		return Summary{}, err
	}
	defer b.Close()

	for _, ddl := range []string{
		`CREATE TABLE inbound (external_id VARCHAR(64) NOT NULL, internal_id VARCHAR(64) NOT NULL, body VARCHAR(255) NOT NULL)`,
		`CREATE TABLE internal_orders (internal_id VARCHAR(64) NOT NULL, external_id VARCHAR(64) NOT NULL)`,
	} {
		if _, err := db.ExecContext(ctx, ddl); err != nil {
			return Summary{}, err
		}
	}

	ob, err := outbox.New(db, outbox.Config{})
	if err != nil {
		return Summary{}, err
	}
	router, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b.Publisher(), Logger: logger, PurgeInterval: -1})
	if err != nil {
		return Summary{}, err
	}
	router.AddMigration(ob.Migrate)

	insertInbound := db.Rebind(`INSERT INTO inbound (external_id, internal_id, body) VALUES (?, ?, ?)`)
	adapter := processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
		internalID, _ := processor.InternalID(ctx)
		tx, _ := processor.TxFromContext(ctx)
		if _, err := tx.ExecContext(ctx, insertInbound, msg.ID, internalID, string(msg.Payload)); err != nil {
			return err
		}
		// The forwarded message is written in the same unit of work, under the internal id.
		fwd := message.NewMessage(internalID, msg.Payload)
		fwd.Metadata.Set("external_id", msg.ID)
		return ob.Publish(ctx, internalTopic, fwd)
	})
	insertInternal := db.Rebind(`INSERT INTO internal_orders (internal_id, external_id) VALUES (?, ?)`)
	consumer := processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
		tx, _ := processor.TxFromContext(ctx)
		_, err := tx.ExecContext(ctx, insertInternal, msg.ID, msg.Header("external_id"))
		return err
	})
	for _, h := range []onceflow.Handler{
		{Name: "inbound", Topic: externalTopic, Processor: adapter,
			Dedup: middleware.Dedup{Mode: middleware.DedupCheckFirst, Table: "id_mapping", Retention: mappingExpiry}},
		{Name: "internal", Topic: internalTopic, Processor: consumer},
	} {
		sub, err := b.Subscriber()
		if err != nil {
			return Summary{}, err
		}
		h.Subscriber, h.DB, h.QoS = sub, db, onceflow.ExactlyOnce
		if err := router.AddHandler(h); err != nil {
			return Summary{}, err
		}
	}
	relay, err := outbox.NewRelay(outbox.RelayConfig{
		DB: db, Publisher: b.Publisher(), Logger: logger,
		PollInterval: 20 * time.Millisecond,
	})
	if err != nil {
		return Summary{}, err
	}

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	routerDone, relayDone := make(chan error, 1), make(chan error, 1)
	go func() { routerDone <- router.Run(runCtx) }()
	select {
	case <-router.Running():
	case err := <-routerDone:
		return Summary{}, err
	}
	go func() { relayDone <- relay.Run(runCtx) }()

	// The external system sends every message once, and some of them a second time, as a
	// partner does when it did not see our acknowledgement.
	s = Summary{}
	var msgs []*message.Message
	for i := range o.Messages {
		m := message.NewMessage(fmt.Sprintf("EXT-%04d", i), []byte(fmt.Sprintf("order %d", i)))
		msgs = append(msgs, m)
		if i < o.Resent {
			msgs = append(msgs, message.NewMessage(m.UUID, m.Payload))
		}
	}
	s.Received = len(msgs)
	if err := b.Publisher().Publish(externalTopic, msgs...); err != nil {
		return s, err
	}

	deadline := time.Now().Add(2 * time.Minute)
	for {
		if err := db.GetContext(ctx, &s.Forwarded, `SELECT COUNT(*) FROM internal_orders`); err != nil {
			return s, err
		}
		st, err := relay.Stats(ctx)
		if err != nil {
			return s, err
		}
		if s.Forwarded >= o.Messages && st.Backlog == 0 {
			break
		}
		if time.Now().After(deadline) {
			return s, fmt.Errorf("after 2 minutes %d of %d internal messages applied", s.Forwarded, o.Messages)
		}
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	if err := errors.Join(<-routerDone, <-relayDone); err != nil {
		return s, err
	}

	if err := db.GetContext(ctx, &s.Mappings, `SELECT COUNT(*) FROM id_mapping`); err != nil {
		return s, err
	}
	if err := db.GetContext(ctx, &s.Forwarded, `SELECT COUNT(*) FROM internal_orders`); err != nil {
		return s, err
	}
	// One internal message per external id, under the internal id its mapping holds.
	var joined int
	if err := db.GetContext(ctx, &joined, `SELECT COUNT(DISTINCT m.message_id) FROM id_mapping m JOIN internal_orders i
		ON i.internal_id = m.internal_id AND i.external_id = m.message_id`); err != nil {
		return s, err
	}
	s.OneToOne = joined == o.Messages && s.Forwarded == o.Messages && s.Mappings == o.Messages
	if err := db.SelectContext(ctx, &s.InternalIDs, `SELECT internal_id FROM id_mapping ORDER BY created_at, message_id`); err != nil {
		return s, err
	}
	s.TimeOrdered = slices.IsSorted(s.InternalIDs)
	var created, expires int64
	if err := db.QueryRowxContext(ctx, `SELECT MIN(created_at), MIN(expires_at) FROM id_mapping`).Scan(&created, &expires); err != nil {
		return s, err
	}
	s.ExpiresInHour = time.Duration((expires - created) * int64(time.Microsecond)).Hours()
	return s, nil
}

func newID() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
