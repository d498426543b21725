package dedup_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/sqldb"
)

// A message is processed in a transaction that records its key first; its redelivery finds the
// key and is acknowledged without being processed again.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "onceflow-dedup-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	db, err := sqldb.Open(ctx, "sqlite://"+filepath.Join(dir, "app.db"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	store, err := dedup.New(db, dedup.Config{}) // table onceflow_dedup, seven days' retention
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}

	deliver := func(attempt int) {
		tx, err := db.BeginTxx(ctx, nil)
		if err != nil {
			log.Fatal(err)
		}
		defer tx.Rollback()
		fresh, err := store.Record(ctx, tx, dedup.Key{Handler: "billing", MessageID: "order-42"}, "")
		if err != nil {
			log.Fatal(err)
		}
		if !fresh {
			fmt.Printf("delivery %d: duplicate, acknowledged without processing\n", attempt)
			return
		}
		// ... the business writes go here, in tx ...
		if err := tx.Commit(); err != nil {
			log.Fatal(err)
		}
		fmt.Printf("delivery %d: processed and committed, then acknowledged\n", attempt)
	}
	deliver(1)
	deliver(2) // the broker redelivers: the ack of delivery 1 was lost

	// Output:
	// delivery 1: processed and committed, then acknowledged
	// delivery 2: duplicate, acknowledged without processing
}
