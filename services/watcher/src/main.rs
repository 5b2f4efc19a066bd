use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    kuryr_watcher::run(kuryr_watcher::Config::parse()).await
}
