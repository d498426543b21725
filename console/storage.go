package console

import (
	"context"
	"fmt"
	"time"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/outbox"
)

// storageDoc is GET api/storage: what the tables of the database hold. A table that does not
// exist is null; an error reading one is in Errors, and the others are shown.
type storageDoc struct {
	Database string     `json:"database"`
	At       time.Time  `json:"at"`
	Dedup    *dedupDoc  `json:"dedup"`
	Outbox   *outboxDoc `json:"outbox"`
	Errors   []string   `json:"errors"`
}

type dedupDoc struct {
	Table string `json:"table"`
	Rows  int64  `json:"rows"`
	// Expired are the rows past their retention, waiting for the next purge.
	Expired   int64         `json:"expired"`
	Oldest    *time.Time    `json:"oldest"`
	LastPurge *lastPurgeDoc `json:"last_purge"`
}

type lastPurgeDoc struct {
	At        time.Time `json:"at"`
	Deleted   int64     `json:"deleted"`
	Batches   int       `json:"batches"`
	TookMilli float64   `json:"took_ms"`
}

type outboxDoc struct {
	Table string `json:"table"`
	Group string `json:"group"`
	// Waiting are the committed messages the relays of Group have not sent; Oldest is when the
	// oldest of them was written, LagSeconds its age.
	Waiting    int64      `json:"waiting"`
	Oldest     *time.Time `json:"oldest"`
	LagSeconds float64    `json:"lag_seconds"`
}

// storageSource reads the storage of the database; it reads whole tables, so it keeps what it
// read for cacheFor.
type storageSource struct {
	cfg   Config
	store *dedup.SQLStore
	box   *outbox.Outbox
	cache cache[storageDoc]
}

func newStorageSource(cfg Config) (*storageSource, error) {
	store, err := dedup.New(cfg.DB, dedup.Config{Table: cfg.DedupTable})
	if err != nil {
		return nil, fmt.Errorf("console: %w", err)
	}
	box, err := outbox.New(cfg.DB, outbox.Config{Table: cfg.OutboxTable})
	if err != nil {
		return nil, fmt.Errorf("console: %w", err)
	}
	return &storageSource{cfg: cfg, store: store, box: box}, nil
}

func (s *storageSource) status(ctx context.Context) storageDoc {
	doc, _ := s.cache.get(ctx, func(ctx context.Context) (storageDoc, error) { return s.read(ctx), nil })
	return doc
}

func (s *storageSource) read(ctx context.Context) storageDoc {
	db := s.cfg.DB
	doc := storageDoc{Database: db.String(), At: now().UTC(), Errors: []string{}}
	fail := func(err error) { doc.Errors = append(doc.Errors, err.Error()) }

	if ok, err := db.TableExists(ctx, s.store.Table()); err != nil {
		fail(err)
	} else if ok {
		d := &dedupDoc{Table: s.store.Table()}
		if st, err := s.store.Stats(ctx); err != nil {
			fail(err)
		} else {
			d.Rows, d.Expired = st.Rows, st.Expired
			if !st.Oldest.IsZero() {
				d.Oldest = ptr(st.Oldest.UTC())
			}
		}
		if p, err := s.store.LastPurge(ctx); err != nil {
			fail(err)
		} else if !p.At.IsZero() {
			d.LastPurge = &lastPurgeDoc{At: p.At.UTC(), Deleted: p.Deleted, Batches: p.Batches, TookMilli: float64(p.Took.Microseconds()) / 1000}
		}
		doc.Dedup = d
	}

	messages, _ := s.box.Tables()
	if ok, err := db.TableExists(ctx, messages); err != nil {
		fail(err)
	} else if ok {
		if st, err := s.box.Stats(ctx, s.cfg.OutboxGroup); err != nil {
			fail(err)
		} else {
			o := &outboxDoc{Table: s.box.Table(), Group: s.cfg.OutboxGroup, Waiting: st.Backlog, LagSeconds: st.Lag.Seconds()}
			if !st.OldestUnsent.IsZero() {
				o.Oldest = ptr(st.OldestUnsent.UTC())
			}
			doc.Outbox = o
		}
	}
	return doc
}
