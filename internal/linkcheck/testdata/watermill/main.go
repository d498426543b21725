// Watermill is the PostgreSQL-only program of testdata/postgres written by hand on watermill:
// a router, a dedup insert and the business insert in one transaction. It is the baseline of
// the binary sizes in docs/performance.md.
package main

import (
	"context"
	"database/sql"
	"log"
	"os"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	_ "github.com/jackc/pgx/v5/stdlib"
)

func main() {
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		log.Fatal(err)
	}
	sub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	router.AddNoPublisherHandler("ledger", "payments", sub, func(m *message.Message) error {
		tx, err := db.BeginTx(m.Context(), nil)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		res, err := tx.ExecContext(m.Context(), `INSERT INTO message_log (id) VALUES ($1) ON CONFLICT DO NOTHING`, m.UUID)
		if err != nil {
			return err
		}
		if n, err := res.RowsAffected(); err != nil || n == 0 {
			return err // a duplicate: acked without processing
		}
		if _, err := tx.ExecContext(m.Context(), `INSERT INTO ledger (payment_id) VALUES ($1)`, m.UUID); err != nil {
			return err
		}
		return tx.Commit()
	})
	if err := router.Run(context.Background()); err != nil {
		log.Fatal(err)
	}
}
