package onceflow

import (
	"context"
	"fmt"
	"maps"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/sqldb"
)

// This file holds the tables the handlers of a router share, one per database and table: the
// dedup stores, the delivery counters and the positions of handlers that detect duplicates by
// offset.

// handlerClaim is a handler name and the topic it consumes, recorded in its dedup store's
// database when the router runs.
type handlerClaim struct {
	store       *dedup.SQLStore
	name, topic string
}

type storeKey struct {
	db    *sqldb.DB
	table string
}

// counterFor returns the delivery counter of h's database, one per database and table.
func (r *Router) counterFor(h Handler) (*dedup.Counter, error) {
	key := storeKey{db: h.DB, table: dedup.DefaultCounterTable}
	if c, ok := r.counters[key]; ok {
		return c, nil
	}
	c, err := dedup.NewCounter(h.DB, dedup.CounterConfig{Retention: h.Dedup.Retention})
	if err != nil {
		return nil, fmt.Errorf("Handler.DeadLetter: %w", err)
	}
	r.counters[key] = c
	return c, nil
}

// positionsFor returns the positions table of h's database, one per database, which Migrate
// creates. The caller holds r.mu.
func (r *Router) positionsFor(h Handler) (*dedup.Positions, error) {
	key := storeKey{db: h.DB, table: dedup.DefaultPositionsTable}
	if p, ok := r.positions[key]; ok {
		return p, nil
	}
	p, err := dedup.NewPositions(h.DB, dedup.PositionsConfig{})
	if err != nil {
		return nil, fmt.Errorf("Handler.Dedup.Mode: %w", err)
	}
	r.positions[key] = p
	r.migrate = append(r.migrate, p.Migrate)
	return p, nil
}

// handlerPositions are one handler's positions, for its subscriber: where it starts each
// partition, and that it hands out each partition's messages in order, one at a time.
type handlerPositions struct {
	positions *dedup.Positions
	handler   string
}

func (p handlerPositions) Applied(ctx context.Context, topic string) (map[int32]int64, error) {
	return p.positions.Load(ctx, p.handler, topic)
}

func (r *Router) storeFor(h Handler) (*dedup.SQLStore, error) {
	table := h.Dedup.Table
	if table == "" {
		table = dedup.DefaultTable
	}
	key := storeKey{db: h.DB, table: table}
	if s, ok := r.stores[key]; ok {
		return s, nil
	}
	s, err := dedup.New(h.DB, dedup.Config{Table: table, Retention: h.Dedup.Retention})
	if err != nil {
		return nil, fmt.Errorf("Handler.Dedup: %w", err)
	}
	r.stores[key] = s
	return s, nil
}

// dedupStore returns the dedup store of h, whose chain is resolved as p: Dedup.Store, else, for
// a chain that records keys, the SQL store of h's database and Dedup.Table, which the router
// claims h's name in when it runs. A chain that records no keys (natural idempotency, offsets)
// has none, and no table is created for it.
func (r *Router) dedupStore(h Handler, p plan) (dedup.Store, error) {
	if h.Dedup.Store != nil || !p.recordsKeys {
		return h.Dedup.Store, nil
	}
	s, err := r.storeFor(h)
	if err != nil {
		return nil, err
	}
	r.claims = append(r.claims, handlerClaim{store: s, name: h.Name, topic: h.Topic})
	return s, nil
}

// dedupStores returns the router's dedup stores, by database and table.
func (r *Router) dedupStores() map[storeKey]*dedup.SQLStore {
	r.mu.Lock()
	defer r.mu.Unlock()
	return maps.Clone(r.stores)
}

// claimHandlers records, in each dedup store's database, the topic each handler consumes, and
// fails when another process uses one of the handler names for another topic: the handler name,
// not the topic, is part of every duplicate-detection key, so the two would take each other's
// messages for duplicates.
func (r *Router) claimHandlers(ctx context.Context) error {
	r.mu.Lock()
	claims := append([]handlerClaim(nil), r.claims...)
	r.mu.Unlock()
	for _, c := range claims {
		if err := c.store.ClaimHandler(ctx, c.name, c.topic); err != nil {
			return fmt.Errorf("Handler.Name: %w", err)
		}
	}
	return nil
}
